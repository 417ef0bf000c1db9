#!/usr/bin/env bash
# wait.sh SECONDS: wait for /root/s17/DONE up to SECONDS, then pack /root/s17 into $OUT/s17.tgz
for i in $(seq 1 $(( $1 / 5 ))); do [ -f /root/s17/DONE ] && break; sleep 5; done
tail -5 /root/s17/drive.log; tail -3 /root/s17/prefetch.log; tail -4 /root/s17/refine.log; tail -3 /root/s17/serve.log
tar -C /root -czf $OUT/s17.tgz --exclude='*.nsys-rep' --exclude='models' s17 2>/dev/null; ls -la $OUT
