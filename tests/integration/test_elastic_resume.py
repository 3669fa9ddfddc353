"""Elastic resume: a checkpoint saved by one gang continued by a gang of another size, on the tiny model over gloo,
with recorded completions (backend ``recorded``: the same completions whatever the gang, so the resumed steps can be
compared number for number with an uninterrupted run).

Tolerance: rel 1e-5 on loss and grad norm of the resumed steps, 1e-6 on reward (measured on the 2-core CPU box,
2026-11-27: 1.3e-6 at most). A resized gang sums the same float32 terms in another order (another split of the rows
over processes, a gloo all-reduce of one or two partial sums); a wrong optimizer state, learning-rate step or batch
moves these numbers by 5e-5 or more: DeepSpeed 0.19.8's universal load alone, before
:func:`grpo_steps.training.gang.separate_step_counts`, moved the second resumed step's grad norm by 1.2e-4, the
no-decay group decayed by it (before :func:`grpo_steps.training.gang.restore_group_settings`) by 7.6e-5 with
``WEIGHT_DECAY``, and consecutive steps differ by 10-30 %.
"""

import json
import math
import shutil
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from grpo_steps.config import validate_config
from grpo_steps.data import prepare
from grpo_steps.elastic import GANG_FILE, ResumeRefused, read_gang
from grpo_steps.launch import launch
from grpo_steps.training.cursor import CURSOR_FILE, PROMPTS_LOG
from grpo_steps.training.job import TrainJob
from tests.integration.flowrun import flow_config, flow_env, flow_run_id
from tests.integration.test_multinode_local import recorded_file

pytestmark = pytest.mark.slow
STEPS, KILL_AT = 4, 2
ROWS_PER_STEP = 8  # completions per optimizer step over all processes: 2 prompts x 4 generations
# large, so that the settings of transformers' two parameter groups (decay / no-decay) matter: DeepSpeed 0.19.8's
# universal load gave both group 0's (grpo_steps.training.gang.restore_group_settings), which moved the second
# resumed step's grad norm by 7.6e-5 with this decay
WEIGHT_DECAY = 1.0


def _job(workdir, model_path, rows, recorded: str, processes: int, deepspeed: bool, resume_from=None,
         max_steps: int = STEPS, tracking: dict | None = None, nodes: int = 1, **train) -> TrainJob:
    grpo = {"weight_decay": WEIGHT_DECAY, **train.pop("grpo", {})}
    config = flow_config(train={"max_steps": max_steps, "save_steps": KILL_AT, "processes_per_node": processes,
                                "num_nodes": nodes, "deepspeed": deepspeed, "trust_checkpoint": True,
                                "per_device_train_batch_size": ROWS_PER_STEP // (processes * nodes), "grpo": grpo,
                                **train},
                         tracking=tracking or {})
    config["generation"].update(backend="recorded", recorded_file=recorded)
    workdir.mkdir(parents=True, exist_ok=True)
    train_file = workdir / "train.jsonl"
    train_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return TrainJob(config=validate_config(config), model_path=model_path, train_file=str(train_file),
                    output_dir=str(workdir / "out"), resume_from=resume_from)


def _steps(workdir) -> dict[int, dict]:
    logs = json.loads((workdir / "out" / "log_history.json").read_text())
    return {h["step"]: h for h in logs if "loss" in h}


def _prompts(workdir) -> dict[int, list[str]]:
    lines = (workdir / "out" / PROMPTS_LOG).read_text().splitlines()
    return {entry["step"]: entry["ids"] for entry in map(json.loads, lines)}


@pytest.fixture(scope="module")
def data(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("elastic")
    rows = prepare(validate_config(flow_config()).data, tiny_tokenizer).train
    return root, rows, recorded_file(root / "recorded.jsonl", rows)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def gang(data, tiny_model_path) -> list:
    """The uninterrupted run: a simulated gang of 2 nodes x 1 process under ZeRO-3 (one launcher per node, each in
    its own directory, as the flow's ``@parallel`` nodes run them), 4 steps, checkpoints at 2 and 4. Its nodes'
    directories; node 0's holds the log."""
    root, rows, recorded = data
    nodes = [root / f"node{i}" for i in range(2)]
    jobs = [_job(d, tiny_model_path, rows, recorded, processes=1, deepspeed=True, nodes=2).model_copy(
        update={"node_index": i}) for i, d in enumerate(nodes)]
    port = _free_port()
    with ThreadPoolExecutor(len(jobs)) as pool:
        for running in [pool.submit(launch, job, node_index=i, main_port=port) for i, job in enumerate(jobs)]:
            running.result()
    return nodes


@pytest.fixture(scope="module")
def reference(gang):
    return gang[0]


def _assert_continues(resumed: dict[int, dict], reference: dict[int, dict]) -> None:
    # the log history holds the checkpoint's steps (from its trainer state), then the resumed ones
    assert sorted(resumed) == list(range(1, STEPS + 1)), sorted(resumed)
    assert all(math.isclose(resumed[s]["loss"], reference[s]["loss"], rel_tol=1e-5) for s in range(1, KILL_AT + 1))
    for step in range(KILL_AT + 1, STEPS + 1):
        ref, got = reference[step], resumed[step]
        rel = 1e-5
        assert ref["grad_norm"] > 0 and ref["loss"] != 0  # a real gradient, not a zero-advantage batch
        assert math.isclose(got["loss"], ref["loss"], rel_tol=rel), (step, got, ref)
        assert math.isclose(got["grad_norm"], ref["grad_norm"], rel_tol=rel), (step, got, ref)
        assert math.isclose(got["reward"], ref["reward"], rel_tol=1e-6), (step, got, ref)
        assert math.isclose(got["learning_rate"], ref["learning_rate"], rel_tol=1e-9), (step, got, ref)


def _assert_prompts_continue(resumed_dir, reference_dir) -> None:
    """The resumed steps trained the very prompts of the uninterrupted run's same steps (logged ids), and the four
    steps of one epoch trained each prompt once."""
    ref_prompts, resumed_prompts = _prompts(reference_dir), _prompts(resumed_dir)
    assert resumed_prompts == {s: ref_prompts[s] for s in range(KILL_AT + 1, STEPS + 1)}
    trained = [i for s in sorted(ref_prompts) for i in ref_prompts[s]]
    assert len(trained) == len(set(trained)) == STEPS * ROWS_PER_STEP // 4


def _through_the_datastore(saved: list[Path], workdir: Path) -> Path:
    """The path ``train.resume_from: FlowName/run_id`` takes for a gang of another number of nodes, in real Metaflow
    runs of :mod:`tests.integration.gang_checkpoint_flow` on the local datastore: a 2-node gang saves each node's
    checkpoint (``saved``) as GRPOFlow's training does, then a 1-node gang's ``train`` step resolves the run by
    :func:`grpo_steps.checkpoints.resume_checkpoint` (each saved node's checkpoint loaded, then merged). Returns the
    checkpoint the 1-node gang got."""
    for node, path in enumerate(saved):
        shutil.copytree(path, workdir / "saved" / f"node{node}")
    env = flow_env()

    def flow(*args: str) -> str:
        done = subprocess.run([sys.executable, str(Path(__file__).with_name("gang_checkpoint_flow.py")), "run", *args],
                              cwd=workdir, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
        return done.stdout + done.stderr

    origin = flow_run_id(flow("--nodes", "2", "--save", str(workdir / "saved")))
    out = flow("--nodes", "1", "--resume-from", f"GangCheckpointFlow/{origin}", "--out", str(workdir / "resolved"))
    for node in range(2):
        assert f"[checkpoint] loading node {node}'s step {KILL_AT} of run GangCheckpointFlow/{origin} (saved by 2 " \
               "nodes)" in out, out[-5000:]
    return workdir / "resolved" / "node0"


def test_a_two_node_zero3_gang_resumed_on_one_process(data, gang, tiny_model_path, tmp_path, capsys):
    """The gang's step-2 checkpoints (each node's: its own ZeRO-3 partition, as a gang killed after them leaves them)
    saved to the datastore by a 2-node gang, loaded and merged into one by a 1-node gang's ``train.resume_from:
    FlowName/run_id`` (:func:`_through_the_datastore`), and continued by one process: converted once to a Universal
    Checkpoint kept beside it."""
    root, rows, recorded = data
    reference = gang[0]
    saved = [node / "out" / f"checkpoint-{KILL_AT}" for node in gang]
    for rank, node_checkpoint in enumerate(saved):  # each node holds only its own rank's partition
        assert [p.name[:15] for p in (node_checkpoint / f"global_step{KILL_AT}").glob("*optim_states.pt")] == \
               [f"zero_pp_rank_{rank}_"]
    checkpoint = _through_the_datastore(saved, tmp_path)
    for rank in range(2):  # both nodes' partitions in the one checkpoint
        assert list((checkpoint / f"global_step{KILL_AT}").glob(f"zero_pp_rank_{rank}_*optim_states.pt"))
    gang_saved = read_gang(checkpoint)
    assert (gang_saved.num_nodes, gang_saved.processes_per_node, gang_saved.zero_stage) == (2, 1, 3)
    assert json.loads((checkpoint / CURSOR_FILE).read_text())["consumed"]  # the prompts of steps 1-2, by id
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    run_id = client.create_run(client.create_experiment("elastic")).info.run_id
    job = _job(tmp_path / "resumed", tiny_model_path, rows, recorded, processes=1, deepspeed=True,
               resume_from=str(checkpoint), tracking={"tracking_uri": uri})
    launch(job.model_copy(update={"mlflow_run_id": run_id}))
    out = capsys.readouterr().out
    assert f"[checkpoint] resuming step {KILL_AT} saved by 2 nodes x 1 process on 1 node x 1 process " \
           "(universal conversion " in out, out[-3000:]
    tags = client.get_run(run_id).data.tags
    assert (tags["resume/saved_gang"], tags["resume/gang"], tags["resume/universal"]) == \
           ("2 nodes x 1 process", "1 node x 1 process", "true")
    assert float(tags["resume/universal_conversion_s"]) > 0
    assert (checkpoint / "latest_universal").read_text() == f"global_step{KILL_AT}_universal"  # kept beside it
    _assert_continues(_steps(tmp_path / "resumed"), _steps(reference))
    _assert_prompts_continue(tmp_path / "resumed", reference)
    assert read_gang(tmp_path / "resumed" / "out" / f"checkpoint-{STEPS}").processes_per_node == 1
    assert (tmp_path / "resumed" / "out" / f"checkpoint-{STEPS}" / GANG_FILE).exists()


def test_another_model_or_optimizer_is_refused_before_training(data, reference, tiny_model_path, tmp_path):
    root, rows, recorded = data
    checkpoint = tmp_path / "checkpoint-2"
    shutil.copytree(reference / "out" / f"checkpoint-{KILL_AT}", checkpoint)
    job = _job(tmp_path / "other", tiny_model_path, rows, recorded, processes=1, deepspeed=True,
               resume_from=str(checkpoint), grpo={"optim": "sgd"})
    with pytest.raises(ResumeRefused, match="optimizer state is 'adamw_torch'.*train.grpo.optim: 'adamw_torch'"):
        launch(job)
    job = _job(tmp_path / "batch", tiny_model_path, rows, recorded, processes=1, deepspeed=True,
               resume_from=str(checkpoint), per_device_train_batch_size=4)
    with pytest.raises(ResumeRefused, match="trained 2 prompts per optimizer step, this run 1"):
        launch(job)
    assert not (tmp_path / "other" / "out").exists()  # refused before the training process started


def test_one_plain_process_resumed_on_two(data, reference, tiny_model_path, tmp_path, capsys):
    """Without DeepSpeed: one process's step-2 checkpoint (of a 4-step run: what a run killed after it leaves)
    continued by two DDP processes (full replicas: no conversion; each new process gets process 0's RNG state).
    Compared with the one process's own steps 3-4 and with the 2-process ZeRO-3 reference (one plain process matches
    it to 1e-6, measured)."""
    root, rows, recorded = data
    launch(_job(tmp_path / "first", tiny_model_path, rows, recorded, processes=1, deepspeed=False))
    checkpoint = tmp_path / "first" / "out" / f"checkpoint-{KILL_AT}"
    launch(_job(tmp_path / "resumed", tiny_model_path, rows, recorded, processes=2, deepspeed=False,
                resume_from=str(checkpoint)))
    out = capsys.readouterr().out
    assert f"[checkpoint] resuming step {KILL_AT} saved by 1 node x 1 process on 1 node x 2 processes\n" in out
    assert {p.name for p in checkpoint.glob("rng_state*")} == {"rng_state.pth", "rng_state_0.pth", "rng_state_1.pth"}
    _assert_continues(_steps(tmp_path / "resumed"), _steps(tmp_path / "first"))
    _assert_continues(_steps(tmp_path / "resumed"), _steps(reference))
    _assert_prompts_continue(tmp_path / "resumed", reference)


def test_lora_under_zero3_on_two_processes_resumed_on_one(data, tiny_model_path, tmp_path, capsys):
    """LoRA (``train.peft``) under ZeRO-3: the base weights are frozen (in no optimizer partition) and only the
    adapter's partitions, with their Adam moments, go through the Universal Checkpoint. A 2-process run's step-2
    checkpoint continued by one process matches the run's own steps 3 and 4 (step 4 after an update made with the
    converted moments; measured 2026-11-27: at most 4e-7 on loss, 6e-7 on grad norm)."""
    root, rows, recorded = data
    lora = {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    launch(_job(tmp_path / "two", tiny_model_path, rows, recorded, processes=2, deepspeed=True, peft=lora))
    checkpoint = tmp_path / "two" / "out" / f"checkpoint-{KILL_AT}"
    assert read_gang(checkpoint).peft == {"r": 8, "alpha": 16.0, "target_modules": ["q_proj", "v_proj"]}
    launch(_job(tmp_path / "one", tiny_model_path, rows, recorded, processes=1, deepspeed=True, peft=lora,
                resume_from=str(checkpoint)))
    out = capsys.readouterr().out
    assert f"[checkpoint] resuming step {KILL_AT} saved by 1 node x 2 processes on 1 node x 1 process (universal " \
           "conversion " in out, out[-3000:]
    _assert_continues(_steps(tmp_path / "one"), _steps(tmp_path / "two"))
    _assert_prompts_continue(tmp_path / "one", tmp_path / "two")
