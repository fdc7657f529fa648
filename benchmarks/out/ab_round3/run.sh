#!/bin/bash
# Alternated before (91ee61d, start of round 3) / after (main f70e153) runs of peers.py and step_overhead.py.
cd /tmp/ab
for r in 1 2; do
  for v in before main; do
    d=/work/wt/$v; [ $v = main ] && d=/work/main
    echo "== round $r $v $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
    (cd $d && PYTHONPATH=$d JAX_PLATFORMS=cpu /work/main/.venv/bin/python benchmarks/step_overhead.py --steps 500 --rounds 3 --resnet-iters 10 --json /tmp/ab/so_${v}_$r.json 2>&1 | tail -25)
    (cd $d && PYTHONPATH=$d JAX_PLATFORMS=cpu /work/main/.venv/bin/python benchmarks/peers.py --models mlp,convnet --iters 8 --sweep "" --json /tmp/ab/peers_${v}_$r.json 2>&1 | tail -25)
  done
done
echo END $(date +%T)
