#!/usr/bin/env bash
# wait.sh SECONDS: wait for /root/s15/DONE up to SECONDS, then pack /root/s15 into $OUT/s15.tgz
for i in $(seq 1 $(( $1 / 5 ))); do [ -f /root/s15/DONE ] && break; sleep 5; done
tail -5 /root/s15/drive.log; tar -C /root -czf $OUT/s15.tgz --exclude='*.nsys-rep' --exclude='models' s15 2>/dev/null; ls -la $OUT
