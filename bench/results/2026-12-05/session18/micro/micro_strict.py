import json, sys, timeit
sys.path.insert(0, sys.argv[1])
from service import vllm_compat as compat
from service.strict_types import check_strict_types
body = {"model": "yardstick", "prompt": list(range(1000, 1128)), "max_tokens": 32, "ignore_eos": True,
        "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
n = 2000
t = timeit.timeit(lambda: check_strict_types(compat.CompletionRequest, body), number=n)
print(f"{sys.argv[1]}: check_strict_types {t / n * 1e6:.1f} us per completion body")
