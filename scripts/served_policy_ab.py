"""Issue 17: served / offline on CPU under the engine process's OpenMP wait policy and the server's and load
generator's CPU priorities, alternating in one process (session 25; loadtest/RESULTS.md).

    python scripts/served_policy_ab.py [ROUNDS] [CONFIG,CONFIG,...]

One offline LLM and one `InProcessServer` per configuration (each with its engine process), all alive at once; each
round times offline, then every configuration's served run (`bench_cpu_serving.served_trial`, 64 x 64, the load
generator in its own process), rotating their order. A configuration's engine environment (OMP_WAIT_POLICY,
GOMP_SPINCOUNT; with neither, an idle server's engine waits passively since session 25) is set only while its
engine process starts: libgomp reads it once, when torch loads, and this process loaded torch first, with the
default policy, for its offline side.
"""
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch  # noqa: F401  this process's libgomp: default policy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from asyncengine.engine_core import OPENMP_WAIT_SETTINGS
from loadtest.bench_cpu_serving import InProcessServer, Offline, make_prompts, served_trial

CONFIGS = {  # name: (engine env, server priority, client priority)
    "A_spin_normal": ({}, "normal", "normal"),
    "B_passive_normal": ({"OMP_WAIT_POLICY": "PASSIVE"}, "normal", "normal"),
    "C_passive_idle_idle": ({"OMP_WAIT_POLICY": "PASSIVE"}, "idle", "idle"),
    "D_passive_idle_normal": ({"OMP_WAIT_POLICY": "PASSIVE"}, "idle", "normal"),
    "E_spin10k_idle_idle": ({"GOMP_SPINCOUNT": "10000"}, "idle", "idle"),
    "F_spin30k_idle_idle": ({"GOMP_SPINCOUNT": "30000"}, "idle", "idle"),
    "G_spin3k_idle_idle": ({"GOMP_SPINCOUNT": "3000"}, "idle", "idle"),
    "H_spin10k_normal": ({"GOMP_SPINCOUNT": "10000"}, "normal", "normal"),
    # libgomp's default spin count, named so that --api-cpu-priority idle keeps it (as before session 25)
    "I_spin_idle_idle": ({"GOMP_SPINCOUNT": "300000"}, "idle", "idle"),
    "J_spin_idle_normal": ({"GOMP_SPINCOUNT": "300000"}, "idle", "normal"),
}


def start(env: dict, priority: str) -> InProcessServer:
    """A started server whose engine process was spawned with `env` added to this process's environment (and
    whatever `let_a_cpu_engine_process_wait_passively` adds for an idle server); both undone afterwards."""
    saved = {k: os.environ.get(k) for k in (*env, *OPENMP_WAIT_SETTINGS)}
    os.environ.update(env)
    try:
        server = InProcessServer({"engine_process": True}, priority).__enter__()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return server


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    names = sys.argv[2].split(",") if len(sys.argv) > 2 else list(CONFIGS)
    prompts = make_prompts(64, 32, 0)
    dataset = str(Path(tempfile.mkdtemp()) / "p.jsonl")
    with open(dataset, "w") as f:
        for ids in prompts:
            f.write(json.dumps({"prompt": ids, "max_tokens": 64}) + "\n")
    offline = Offline(prompts, 64, {})
    servers = {}
    for name in names:
        env, prio, _ = CONFIGS[name]
        servers[name] = s = start(env, prio)
        served_trial(s.url, dataset, 16, 64, "subprocess")
        served_trial(s.url, dataset, 64, 2, "subprocess")
    ratios = {n: [] for n in names}
    for r in range(rounds):
        off = offline.trial()["output_tok_s"]
        order = names[r % len(names):] + names[:r % len(names)]
        line = [f"round {r}: offline {off:.0f}"]
        for name in order:
            s = servers[name]
            res = served_trial(s.url, dataset, 64, 64, "subprocess", s.engine.client.process.pid, CONFIGS[name][2])
            ratios[name].append(res["output_tok_s"] / off)
            cpu = {k: round(v * 1e6 / res["output_tokens"]) for k, v in res["cpu_s"].items()}
            line.append(f"{name} {res['output_tok_s']:.0f} ({res['output_tok_s'] / off:.3f}) cpu {cpu}")
        print(" | ".join(line), flush=True)
    for name in names:
        print(f"{name}: served/offline median {statistics.median(ratios[name]):.3f} "
              f"({min(ratios[name]):.3f}-{max(ratios[name]):.3f})", flush=True)
    for s in servers.values():
        s.__exit__(None, None, None)


if __name__ == "__main__":
    main()
