#!/usr/bin/env bash
# wait.sh SECONDS: wait for /root/s13/DONE up to SECONDS, then pack /root/s13 into $OUT/s13.tgz
for i in $(seq 1 $(( $1 / 5 ))); do [ -f /root/s13/DONE ] && break; sleep 5; done
tar -C /root -czf $OUT/s13.tgz --exclude='*.nsys-rep' s13 2>/dev/null; ls -la $OUT
