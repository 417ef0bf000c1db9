#!/usr/bin/env bash
# wait.sh SECONDS: wait for /root/s14/DONE up to SECONDS, then pack /root/s14 into $OUT/s14.tgz
for i in $(seq 1 $(( $1 / 5 ))); do [ -f /root/s14/DONE ] && break; sleep 5; done
tail -5 /root/s14/drive.log; tar -C /root -czf $OUT/s14.tgz --exclude='*.nsys-rep' s14 2>/dev/null; ls -la $OUT
