"""k3dist entry point (Hydra): `python launch.py [overrides]`, `torchrun --nproc_per_node=N launch.py [overrides]`.

Not under torchrun, `dist.nproc=N` > 1 starts the N ranks here through torch's elastic launcher. Rank 0 owns the
Hydra run dir and writes result.json there (or to `out`); other ranks create no dir and write no `.hydra/`.
"""

import logging
import os
import sys
import uuid
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from k3dist.errors import K3Error

QUIET_RANK_OVERRIDES = [
    "hydra.output_subdir=null",
    "hydra.run.dir=.",
    "hydra/job_logging=none",
    "hydra/hydra_logging=none",
]


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or {"RANK", "WORLD_SIZE", "MASTER_ADDR"} <= set(os.environ)


def spawn(job: dict, nproc: int) -> None:
    """Start `nproc` ranks on this machine (torch elastic, spawn); a failed rank fails the job."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from k3dist.dist import free_port
    from k3dist.job import rank_entry

    for name in list(logging.root.manager.loggerDict):  # the agent's own logs would bury the `error:` lines
        if name.startswith(("torch.distributed.elastic", "torch.multiprocessing")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"k3dist-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    try:
        elastic_launch(config, rank_entry)(job)
    except ChildFailedError as exc:
        odd = {r: f.exitcode for r, f in exc.failures.items() if f.exitcode != 1}
        if odd:  # ranks that did not print their own error line (killed, crashed)
            raise K3Error(f"ranks {sorted(odd)} died (exit codes {odd}); every rank was stopped") from None
        sys.exit(1)


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    job = OmegaConf.to_container(cfg, resolve=True)
    if job.get("out") is None:
        job["out"] = str(Path(HydraConfig.get().runtime.output_dir) / "result.json")
    try:
        if under_torchrun() or job["dist"]["nproc"] == 1:
            from torch.distributed.elastic.multiprocessing.errors import record

            from k3dist.job import run_rank

            record(run_rank)(job)
        else:
            spawn(job, int(job["dist"]["nproc"]))
    except K3Error as exc:
        from k3dist.job import exit_with_error

        exit_with_error(exc)


if __name__ == "__main__":
    if under_torchrun() and os.environ.get("RANK", "0") != "0":
        sys.argv += QUIET_RANK_OVERRIDES
    main()
