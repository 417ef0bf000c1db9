#!/usr/bin/env bash
# wait.sh SECONDS: wait for /root/s16/DONE up to SECONDS, then pack /root/s16 into $OUT/s16.tgz
for i in $(seq 1 $(( $1 / 5 ))); do [ -f /root/s16/DONE ] && break; sleep 5; done
tail -5 /root/s16/drive.log; tail -3 /root/s16/serve.log
tar -C /root -czf $OUT/s16.tgz --exclude='*.nsys-rep' --exclude='models' s16 2>/dev/null; ls -la $OUT
