"""`torchrun -m launcher.cli run` (one process per rank) against `lockstep run --launcher ray`.

Both launchers run the same YAML (DP=2, gloo, float64) on the same prompts file; the output
files must hold the same records. The torchrun job's MoE all-to-alls go through shared memory
(`moe_exchange: auto` on one host), the Ray job's through the gloo group (`process_group`).
Sharding: torchrun sends prompt i to rank i mod world unless pinned; Ray's round-robin router
cycles over the unpinned prompts only. The two agree when no prompt is pinned before an
unpinned one, and each honours a pin, so we check each against its own documented rule and
the tokens against a single-rank reference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import LLM, SamplingParams

pytestmark = pytest.mark.multirank

BIN = Path(sys.executable).parent
TORCHRUN = str(BIN / "torchrun")
LOCKSTEP = str(BIN / "lockstep")
TIMEOUT_S = 240

PROMPTS = [
    {"prompt_token_ids": [(5 * i + 3 * j) % 383 + 1 for j in range(3 + i)], "max_tokens": 4 + i}
    for i in range(6)
] + [
    {"prompt": "hello experts", "max_tokens": 5},
    {"prompt_token_ids": [9, 8, 7, 6], "max_tokens": 3, "dp_rank": 0},  # pinned against i % 2
    {"prompt_token_ids": [11, 12], "max_tokens": 7},
]
for _line in PROMPTS:
    # Greedy, as the reference: a line without temperature samples at the model's default.
    _line.update(ignore_eos=True, temperature=0)


@pytest.fixture(scope="module")
def job(tmp_path_factory, model_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("torchrun_job")
    model = model_dir
    config = root / "job.yaml"
    config.write_text(
        f"model: {model}\n"
        "dtype: float64\n"
        "parallel: {dp_size: 2, launcher: torchrun, backend: gloo, collective_timeout_s: 30}\n"
        "scheduler: {max_num_seqs: 8, max_model_len: 128, num_blocks: 128, block_size: 4}\n"
    )
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in PROMPTS))
    return {"root": root, "config": config, "prompts": prompts}


def start(argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    environ = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    environ.update(RAY_AUTH_MODE="disabled", **(env or {}))
    return subprocess.Popen(
        argv, cwd=cwd, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finish(process: subprocess.Popen) -> subprocess.CompletedProcess:
    try:
        stdout, stderr = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, stderr = process.communicate()
        pytest.fail(
            f"{process.args[:3]} ran past {TIMEOUT_S}s\nstdout:\n{stdout}\nstderr:\n{stderr}"
        )
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def run(
    argv: list[str], cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return finish(start(argv, cwd, env))


def check(result: subprocess.CompletedProcess, code: int = 0) -> None:
    assert result.returncode == code, (
        f"exit {result.returncode}\nstdout:\n{result.stdout[-4000:]}\n"
        f"stderr:\n{result.stderr[-8000:]}"
    )


def torchrun_argv(nproc: int, *args: str) -> list[str]:
    return [TORCHRUN, "--standalone", "--nproc-per-node", str(nproc), *args]


def torchrun(nproc: int, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return run(torchrun_argv(nproc, *args), cwd)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def outputs(job) -> dict[str, list[dict]]:
    root, config, prompts = job["root"], str(job["config"]), str(job["prompts"])
    out_torchrun, out_ray = root / "out_torchrun.jsonl", root / "out_ray.jsonl"
    # The two jobs run at once: most of each one's time is start-up (imports, Ray, rendezvous).
    torchrun_job = start(
        torchrun_argv(
            2, "-m", "launcher.cli", "run", "--config", config, "--prompts", prompts,
            "--output", str(out_torchrun), "--quiet",
        ),
        root,
    )  # fmt: skip
    ray_job = start(
        [LOCKSTEP, "run", "--config", config, "--launcher", "ray", "--dp-size", "2",
         "--prompts", prompts, "--output", str(out_ray), "--quiet",
         "--set", "parallel.moe_exchange=process_group"],
        root,
    )  # fmt: skip
    try:
        result, ray_result = finish(torchrun_job), finish(ray_job)
    finally:  # neither outlives a failure of the other
        for process in (torchrun_job, ray_job):
            if process.poll() is None:
                process.kill()
                process.communicate()
    check(result)
    # Only rank 0 prints the summary (every process runs the same command).
    assert result.stdout.count("launcher / DP          torchrun / 2") == 1, result.stdout
    assert "MoE exchange           shared memory" in result.stdout, result.stdout
    result = ray_result
    check(result)
    assert "launcher / DP          ray / 2" in result.stdout
    assert "MoE exchange           gloo" in result.stdout, result.stdout  # process_group
    return {"torchrun": records(out_torchrun), "ray": records(out_ray)}


@pytest.fixture(scope="module")
def reference(job) -> list[list[int]]:
    prompts = [line.get("prompt", line.get("prompt_token_ids")) for line in PROMPTS]
    params = [SamplingParams(max_tokens=line["max_tokens"], ignore_eos=True) for line in PROMPTS]
    with LLM(config=job["config"], launcher="local", dp_size=1) as llm:
        return [o.output_token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_torchrun_and_ray_write_the_same_records(outputs, reference):
    def without_rank(recs):
        return [{k: v for k, v in r.items() if k != "dp_rank"} for r in recs]

    assert len(outputs["torchrun"]) == len(PROMPTS)
    assert without_rank(outputs["torchrun"]) == without_rank(outputs["ray"])
    assert [r["index"] for r in outputs["torchrun"]] == list(range(len(PROMPTS)))
    assert [r["output_token_ids"] for r in outputs["torchrun"]] == reference
    assert [len(r["output_token_ids"]) for r in outputs["torchrun"]] == [
        line["max_tokens"] for line in PROMPTS
    ]
    assert all(r["finish_reason"] == "length" for r in outputs["torchrun"])


def test_each_launcher_shards_by_its_documented_rule(outputs):
    # Worked by hand from PROMPTS: nine prompts, the eighth (index 7) pinned to rank 0.
    assert [line.get("dp_rank") for line in PROMPTS] == [None] * 7 + [0, None]
    # torchrun: prompt i on rank i mod 2 unless pinned, so index 8 goes to rank 0.
    assert [r["dp_rank"] for r in outputs["torchrun"]] == [0, 1, 0, 1, 0, 1, 0, 0, 0]
    # Ray: round robin over the unpinned prompts in input order (indices 0-6, then 8), pins
    # honoured: index 8 is the eighth unpinned prompt, rank 1. Both honour the pin.
    assert [r["dp_rank"] for r in outputs["ray"]] == [0, 1, 0, 1, 0, 1, 0, 0, 1]


# Run by every rank of the torchrun job below, and by the test on a single local rank:
# two prompts (one per rank) with n = 2, sampled, then again with a stop string taken from
# the first run's text.
N_AND_STOP = """
def n_and_stop(llm):
    sampled = dict(max_tokens=12, temperature=1.0, seed=4, n=2, ignore_eos=True, logprobs=2)
    prompts = ["hello experts", [4, 5, 6]]
    free = llm.generate(prompts, SamplingParams(**sampled), use_tqdm=False)
    text = free[1].outputs[1].text
    whole = [i for i in range(len(text) // 2, len(text) - 1) if "\\ufffd" not in text[i : i + 2]]
    start = whole[0]
    cut = llm.generate(prompts, SamplingParams(stop=text[start : start + 2], **sampled),
                       use_tqdm=False)
    samples = [[c.index, c.token_ids, c.text, c.finish_reason] for o in cut for c in o.outputs]
    # Logprobs cross the results exchange too (rounded: the two groups batch differently).
    logprobs = [[[sorted(entry) for entry in c.logprobs], round(c.cumulative_logprob, 3)]
                for o in free for c in o.outputs]
    return {"free": [c.token_ids for o in free for c in o.outputs], "cut": samples,
            "logprobs": logprobs}
"""


@pytest.fixture(scope="module")
def api_job(job) -> dict[int, list[str]]:
    """`LLM(launcher="torchrun")` in a script under torchrun (2 ranks); each rank's report lines."""
    script = job["root"] / "api.py"
    # Each rank writes its own file: two processes printing to one pipe can interleave bytes.
    script.write_text(
        "import json, os\n"
        "from launcher import LLM, SamplingParams\n"
        f"{N_AND_STOP}"
        "lines = []\n"
        f"with LLM(config={str(job['config'])!r}) as llm:\n"
        "    lines.append(f'CORES {llm.client.cpu_cores} {sorted(os.sched_getaffinity(0))}')\n"
        "    params = SamplingParams(max_tokens=3, ignore_eos=True)\n"
        "    try:\n"
        "        llm.generate([[1, 2, 3], [4, 5]], params, dp_rank=[0, 5], use_tqdm=False)\n"
        "    except ValueError as error:\n"
        "        lines.append(f'RAISED {error}')\n"
        "    outs = llm.generate([[1, 2, 3], [4, 5]], params, use_tqdm=False)\n"
        "    ranks = [o.dp_rank for o in outs]\n"
        "    lengths = [len(o.output_token_ids) for o in outs]\n"
        "    lines.append(f'SERVED {ranks} {lengths}')\n"
        "    lines.append('NSTOP ' + json.dumps(n_and_stop(llm)))\n"
        "with open(f\"api_rank{os.environ['RANK']}.txt\", 'w') as out:\n"
        "    out.write('\\n'.join(lines))\n"
    )
    # One torch thread per rank, whatever the caller's environment says (torchrun's default).
    result = run(
        [TORCHRUN, "--standalone", "--nproc-per-node", "2", str(script)],
        job["root"],
        env={"OMP_NUM_THREADS": "1"},
    )
    check(result)
    return {r: (job["root"] / f"api_rank{r}.txt").read_text().splitlines() for r in range(2)}


def test_an_out_of_range_pin_raises_on_every_rank(api_job):
    # Under torchrun a pin outside [0, world) used to be served by no rank: every process then
    # failed with a KeyError when collecting results. It must be a clear ValueError, after
    # which the group still serves.
    for lines in api_job.values():
        assert lines[1:3] == ["RAISED dp_rank must be in [0, 2), got 5", "SERVED [0, 1] [3, 3]"]


def test_n_samples_and_stop_strings_reach_every_rank_as_one_rank_serves_them(api_job, job):
    """Prompt i's samples all run on rank i mod 2; every rank returns every prompt's samples
    (text rebuilt from the exchanged tokens) as a single local rank gives them."""
    namespace: dict = {"SamplingParams": SamplingParams}
    exec(N_AND_STOP, namespace)
    with LLM(config=job["config"], launcher="local", dp_size=1) as llm:
        expected = namespace["n_and_stop"](llm)
    assert any(reason == "stop" for _, _, _, reason in expected["cut"])
    assert [index for index, *_ in expected["cut"]] == [0, 1, 0, 1]
    for lines in api_job.values():
        (line,) = [line for line in lines if line.startswith("NSTOP ")]
        assert json.loads(line.removeprefix("NSTOP ")) == expected


def test_torchrun_ranks_are_pinned_to_disjoint_cores(api_job):
    """parallel.cpu_binding (on by default) under torchrun: with one thread each, local rank r
    runs on the r-th available core, gloo's threads included; left unpinned if they do not fit."""
    available = sorted(os.sched_getaffinity(0))
    for rank, lines in api_job.items():
        expected = [available[rank]] if len(available) >= 2 else []
        affinity = expected or available
        assert lines[0] == f"CORES {expected} {affinity}", (rank, lines)


def test_an_llm_left_open_exits_cleanly(job):
    """No `with`, no shutdown(): the LLM is shut down at interpreter exit, before finalization.
    Left to finalization, gloo's threads aborted the process after the job succeeded
    ('terminate called without an active exception', 8 of 8 runs before the fix)."""
    script = job["root"] / "left_open.py"
    script.write_text(
        "import os\n"
        "from launcher import LLM, SamplingParams\n"
        f"llm = LLM(config={str(job['config'])!r})\n"
        "params = SamplingParams(max_tokens=3, ignore_eos=True)\n"
        "outs = llm.generate([[1, 2, 3], [4, 5]], params, use_tqdm=False)\n"
        "with open(f\"left_open_rank{os.environ['RANK']}.txt\", 'w') as out:\n"
        "    out.write(str([len(o.output_token_ids) for o in outs]))\n"
    )
    result = torchrun(2, str(script), cwd=job["root"])
    check(result)
    assert "terminate called" not in result.stderr
    for rank in range(2):
        assert (job["root"] / f"left_open_rank{rank}.txt").read_text() == "[3, 3]"


def test_a_world_size_that_differs_from_dp_size_is_refused(job):
    result = torchrun(
        1, "-m", "launcher.cli", "run", "--config", str(job["config"]),
        "--prompts", str(job["prompts"]), cwd=job["root"],
    )  # fmt: skip
    assert result.returncode != 0
    assert "torchrun started 1 processes but parallel.dp_size is 2" in result.stderr
