#!/usr/bin/env bash
# Runs job.py as 2 processes x 16 CPU devices until one does not exit within 25 s, then dumps the
# ranks' native stacks with gdb (stacks_*.txt) and stops. Run from anywhere, as root for gdb;
# the rate rises with the machine's load (README.md).
cd "$(dirname "$0")/../../.." || exit 1
here=benchmarks/out/exit_hang
for i in $(seq 1 300); do
  XLA_FLAGS="--xla_force_host_platform_device_count=16" JAX_PLATFORMS=cpu PYTHONPATH="$PWD" \
    timeout 60 .venv/bin/python -m jddp.launch -n 2 --timeout 50 "$here/job.py" > /tmp/exit_hang_out.txt 2>&1 &
  lp=$!
  for _ in $(seq 1 50); do sleep 0.5; kill -0 $lp 2>/dev/null || break; done
  if kill -0 $lp 2>/dev/null; then
    for pid in $(pgrep -f "$here/job.py"); do
      grep -q "jddp.launch" /proc/"$pid"/cmdline || \
        timeout 100 gdb -p "$pid" -batch -ex 'thread apply all bt' > "/tmp/exit_hang_stacks_$pid.txt" 2>&1
    done
    wait $lp; echo "$i hung (stacks in /tmp/exit_hang_stacks_*.txt)"; exit 0
  fi
  wait $lp; echo "$i rc=$?"
done
