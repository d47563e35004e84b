"""How the engines are told to submit their own batch jobs: the pure parts, without a cluster.

The same engines on the Slurm lab cluster are in tests/slurm/test_engines_on_slurm.py.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
from hetflow.tasks.backends.dask import check_options
from hetflow.tasks.backends.jobqueue import slurm_cluster_kwargs
from hetflow.tasks.backends.radical import resource_config
from hetflow.tasks.backends.ranks import RankRun, launch_argv
from hetflow.tasks.errors import ConfigError
from hetflow.tasks.launchers.srun import step_env
from hetflow.tasks.pilot import PilotDescription
from hetflow.tasks.scheduler import RankSlot

DASK = PilotDescription(name="lab-dask", backend="dask", nodes=2, cores_per_node=3, gpus_per_node=1,
                        memory_per_node=2**30, walltime=5400, options={"dask": {"jobqueue": "slurm"}})


@pytest.mark.parametrize("options, message", [
    ({"jobqueue": "pbs"}, "options.dask.jobqueue is 'pbs' (allowed: ['slurm']"),
    ({"jobqueue": "slurm", "address": "tcp://h:8786"}, "options.dask.address and options.dask.jobqueue"),
    ({"worker_init": "module load x"}, "options.dask.worker_init needs options.dask.jobqueue"),
])
def test_dask_jobqueue_options_are_checked(options: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match="lab-dask") as error:
        check_options(dataclasses.replace(DASK, options={"dask": options}))
    assert message in str(error.value)


def test_slurm_cluster_asks_for_whole_nodes_and_the_pilots_cores(tmp_path: Path) -> None:
    options = {"jobqueue": "slurm", "scheduler_options": "#SBATCH --constraint=cpu\n\n#SBATCH --qos=debug",
               "worker_init": "module load python\n"}
    kwargs = slurm_cluster_kwargs(DASK, tmp_path, options)
    assert kwargs["cores"] == 3 and kwargs["processes"] == 1 and kwargs["walltime"] == "01:30:00"
    assert kwargs["job_extra_directives"] == ["--exclusive", "--constraint=cpu", "--qos=debug"]
    assert kwargs["job_directives_skip"] == ["--mem"]
    assert kwargs["job_script_prologue"] == ["module load python"]
    # dask-jobqueue writes these into the job script unquoted: one word
    assert kwargs["worker_extra_args"] == ["--resources", "cores=3,gpus=1"]
    assert kwargs["local_directory"].startswith(str(tmp_path)) and kwargs["log_directory"].startswith(str(tmp_path))


def test_scheduler_options_lines_must_be_sbatch_lines(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'--qos=debug' does not start with '#SBATCH'"):
        slurm_cluster_kwargs(DASK, tmp_path, {"jobqueue": "slurm", "scheduler_options": "--qos=debug"})


def test_an_engines_srun_task_is_one_job_step_with_the_step_environment(tmp_path: Path) -> None:
    run = RankRun(task_id="run/stage/1", command=("python", "w.py"), slots=(RankSlot(0, (0,)), RankSlot(1, (0,))),
                  launcher="srun", cwd=str(tmp_path), cancel_file=str(tmp_path / "cancel"),
                  launcher_executable="/usr/bin/srun")
    argv = launch_argv(run, ["e1", "e2"])
    assert argv[:4] == ["/usr/bin/srun", "--nodes=2", "--ntasks=2", "--nodelist=e1,e2"]
    assert {"--distribution=arbitrary", "--exact", "--kill-on-bad-exit=1", "--mpi=pmi2"} <= set(argv)
    assert argv[-2:] == ["python", "w.py"]
    # a batch script's --ntasks-per-node (Parsl's, RP's) must not cap the step; a user's setting wins
    env = step_env({"SLURM_NTASKS_PER_NODE": "1", "SLURM_JOB_ID": "7", "MPIR_CVAR_CH4_NETMOD": "ucx"}, {"X": "1"})
    assert "SLURM_NTASKS_PER_NODE" not in env and env["SLURM_JOB_ID"] == "7" and env["X"] == "1"
    assert env["MPIR_CVAR_CH4_NETMOD"] == "ucx"
    assert step_env({}, {})["MPIR_CVAR_CH4_NETMOD"] == "ofi"
    assert not [k for k in step_env({}, {}) if "AUTO_PROGRESS" in k]  # it hung MPI_Init now and then


@pytest.mark.parametrize("resource", ["hetflow.slurm", "local"])
def test_rp_agent_runs_this_python_not_the_shells_active_env(resource: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # RP's virtenv_mode 'local' makes the bootstrapper activate $VIRTUAL_ENV: with another venv active
    # (or none there on the compute nodes) the agent never starts.
    monkeypatch.setenv("VIRTUAL_ENV", str(tmp_path / "another-venv"))
    pilot = PilotDescription(name="lab-radical", backend="radical", resource=resource, nodes=2, cores_per_node=1,
                             gpus_per_node=0, memory_per_node=2**30)
    (config,) = (host for hosts in resource_config(pilot, tmp_path).values() for host in hosts.values())
    assert config["virtenv_mode"] == "none" and config["rp_version"] == "installed"
    assert config["python_interpreter"] == sys.executable
    assert config["pre_bootstrap_0"][0] == f"export PATH={Path(sys.executable).parent}:$PATH"
