"""The operator's worker pods pass the job's settings in the environment; tenplex.elastic.Job takes them wherever
the script leaves an argument out (pure parsing with golden values, and a real one-rank gloo Job)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tenplex.elastic.envsettings import env_from_settings, settings_from_env
from tenplex.errors import ConfigError
from tenplex.ports import free_port

K8S = Path(__file__).resolve().parent.parent / "k8s"


def test_settings_from_env_golden():
    env = {"TENPLEX_MAX_TP": "4", "TENPLEX_PP": "2", "TENPLEX_REPLICAS": "0", "TENPLEX_SAVE_INTERVAL": "50",
           "TENPLEX_PINNED": '{"24": "tp=8,pp=3", "4": "dp=4"}', "TENPLEX_DATASET": "/var/lib/tenplex/data/ex",
           "TENPLEX_HOST": "h0"}
    assert settings_from_env(env) == {"max_tp": 4, "pp": 2, "replicas": 0, "save_every": 50,
                                      "pinned": {24: "tp=8,pp=3", 4: "dp=4"}, "dataset": "/var/lib/tenplex/data/ex"}
    assert settings_from_env({}) == {} and settings_from_env({"TENPLEX_PP": " ", "TENPLEX_PINNED": ""}) == {}


def test_env_from_settings_is_what_settings_from_env_reads_back():
    settings = {"max_tp": 4, "pp": 2, "pinned": {24: "tp=8,pp=3", 4: "dp=4"}, "replicas": 0, "save_every": 50,
                "dataset": "/var/lib/tenplex/data/ex"}
    env = env_from_settings(**settings)
    assert env == {"TENPLEX_MAX_TP": "4", "TENPLEX_PP": "2", "TENPLEX_REPLICAS": "0", "TENPLEX_SAVE_INTERVAL": "50",
                   "TENPLEX_PINNED": '{"4": "dp=4", "24": "tp=8,pp=3"}', "TENPLEX_DATASET": "/var/lib/tenplex/data/ex"}
    assert settings_from_env(env) == settings
    assert env_from_settings() == {} and env_from_settings(pinned={}) == {}


def test_the_operators_worker_pod_settings_reach_the_job():
    # the example TenplexJob's worker pod, as the operator builds it, read back as the Job reads its environment
    import yaml

    from tenplex.operator.pods import WorkerSettings, worker_pod
    from tenplex.operator.spec import parse_spec

    example = next(yaml.safe_load_all((K8S / "examples" / "tenplexjob.yaml").read_text()))
    job = {**example, "metadata": {**example["metadata"], "uid": "1234"}}
    pod = worker_pod(job, parse_spec(example["spec"]), "node-a", WorkerSettings())
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"] if "value" in e}
    assert settings_from_env(env) == {"max_tp": 8, "replicas": 1, "save_every": 50, "pinned": {24: "tp=8,pp=3"}}
    # the dataset: `tenplex run --dataset` mounts the job's view and sets TENPLEX_DATASET for the workers
    command = pod["spec"]["containers"][0]["command"]
    assert command[command.index("--dataset") + 1] == "/var/lib/tenplex/datasets/example"


@pytest.mark.parametrize("var,value,match", [
    ("TENPLEX_MAX_TP", "0", "TENPLEX_MAX_TP='0': expected a whole number >= 1"),
    ("TENPLEX_PP", "two", "TENPLEX_PP='two'"),
    ("TENPLEX_REPLICAS", "-1", "TENPLEX_REPLICAS='-1': expected a whole number >= 0"),
    ("TENPLEX_SAVE_INTERVAL", "1.5", "TENPLEX_SAVE_INTERVAL"),
    ("TENPLEX_PINNED", "{tp=2}", "TENPLEX_PINNED is not JSON"),
    ("TENPLEX_PINNED", '{"x": "tp=2"}', "from world sizes to configurations"),
    ("TENPLEX_PINNED", '["tp=2"]', "from world sizes to configurations"),
])
def test_malformed_settings_name_the_variable(var, value, match):
    with pytest.raises(ConfigError, match=match.replace("(", r"\(").replace("[", r"\[")):
        settings_from_env({var: value})


SCRIPT = """
import json, sys
import tenplex.elastic
out = {}
job = tenplex.elastic.Job(global_batch=4)
out["env"] = [job.choice.degrees(), job.choice.reason, job.save_every, job.checkpointer_options["replicas"],
              str(job.dataset)]
explicit = tenplex.elastic.Job(global_batch=4, max_tp=1, save_every=3, replicas=2, dataset="mine/")
out["explicit"] = [explicit.save_every, explicit.checkpointer_options["replicas"], str(explicit.dataset)]
try:
    tenplex.elastic.Job(global_batch=4, max_tp=0)  # explicit, so it wins over TENPLEX_MAX_TP, and is refused
except Exception as e:
    out["max_tp=0"] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
job.finish()
"""


def test_a_job_takes_the_launchers_settings_unless_the_script_passes_its_own(tmp_path):
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), TENPLEX_HOST="h0", TENPLEX_STORE_ROOT=str(tmp_path / "h0"),
               TENPLEX_MAX_TP="1", TENPLEX_PINNED='{"1": "dp=1"}', TENPLEX_REPLICAS="0",
               TENPLEX_SAVE_INTERVAL="7", TENPLEX_DATASET="/data/view", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    degrees, reason, *rest = doc["env"]
    assert degrees == "dp=1,tp=1,pp=1" and "pinned for world size 1" in reason, reason
    assert rest == [7, 0, "/data/view"]
    assert doc["explicit"] == [3, 2, "mine/"]
    assert doc["max_tp=0"].startswith("ConfigError") and "max_tp" in doc["max_tp=0"], doc["max_tp=0"]
