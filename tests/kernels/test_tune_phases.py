"""kernels.tune.tune_shape's search logic with a stand-in cost (no GPU): phase D gives a bucket
its neighbour's winner when one-dimension walks cannot reach it."""
from __future__ import annotations

from kernels import configs, tune

E, N, K, TOPK = 8, 1792, 4096, 2


def test_neighbours_winner_reaches_a_bucket_the_one_dim_walk_cannot(monkeypatch) -> None:
    base = configs.default_config(128, E, N, K, TOPK, "bf16")
    # two GEMM1 dimensions away from bucket 128's start: phase B moves one at a time
    far = configs.validate({**base, "BLOCK_K": 64 if base["BLOCK_K"] == 128 else 128,
                            "num_stages": 3 if base["num_stages"] != 3 else 4})
    assert tune._legal(far, N, K, "bf16")
    start = configs.default_config
    monkeypatch.setattr(configs, "default_config",
                        lambda M, *a, **k: far if M == 256 else start(M, *a, **k))
    monkeypatch.setattr(tune, "make_problem", lambda *a, **k: {"M": a[4], "weights": None})
    monkeypatch.setattr(tune, "_compiles_ok", lambda *a: True)
    timed: list[tuple[int, dict]] = []

    def cost_us(prob: dict, cfg: dict, replays: int = 20) -> float:
        timed.append((prob["M"], cfg))
        same = configs.validate(cfg) == far
        return {256: 1.0 if same else 2.0, 128: 1.5 if same else 2.0}.get(prob["M"], 2.0)

    monkeypatch.setattr(tune, "time_ours", cost_us)
    table = tune.tune_shape(E, N, K, TOPK, "bf16", (64, 128, 256), budget_s=600, device="cpu",
                            log=lambda *a: None, parallel=False)
    assert configs.validate(table[256]) == far
    assert configs.validate(table[128]) == far      # only phase D offers it to bucket 128
    assert any(m == 128 and configs.validate(c) == far for m, c in timed)
