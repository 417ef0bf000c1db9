"""moe-serve's benchmarks, run as `moe-serve bench serve` (the yardstick: whole models over HTTP
against `vllm serve`) and `moe-serve bench kernels` (the expert kernels against vLLM's and the
streaming floor); `moe-serve bench tables` regenerates the shown results from bench/results/."""
