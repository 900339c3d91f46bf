"""k3dist entry point (Hydra): `python launch.py [overrides]`, `torchrun --nproc_per_node=N launch.py [overrides]`.

Not under torchrun, `dist.nproc=N` > 1 starts the N ranks here through torch's elastic launcher. Rank 0 owns the
Hydra run dir and writes result.json there (or to `out`); other ranks create no dir and write no `.hydra/`.
`python launch.py -m ...` sweeps: one job per point, each starting its own ranks; a refused point does not end the
sweep, and a summary of every point is written at the end (k3dist/run/sweep.py).
"""

import logging
import os
import sys
import uuid
from functools import partial
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from k3dist.base import allocator, signals, threads
from k3dist.base.errors import K3Error

QUIET_RANK_OVERRIDES = [
    "hydra.output_subdir=null",
    "hydra.run.dir=.",
    "hydra/job_logging=none",
    "hydra/hydra_logging=none",
]


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or {"RANK", "WORLD_SIZE", "MASTER_ADDR"} <= set(os.environ)


def rank_zero() -> bool:
    """Whether this process speaks for the run: torchrun's rank 0, or the launcher itself."""
    return os.environ.get("RANK", "0") == "0" if under_torchrun() else True


def launch_ranks(job: dict, nproc: int, entry) -> dict:
    """Run `entry(job)` on `nproc` ranks started here (torch elastic, spawn); returns each rank's return value."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from k3dist.base.dist import free_port

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
        try:
            with signals.held_for_children():
                return elastic_launch(config, entry)(job)
        finally:  # torch elastic leaves its handlers behind: their SignalException a sweep's next point would swallow
            signals.as_launcher(announce=True)
    except SignalException as exc:  # the agent already forwarded the signal to the ranks and waited for them
        raise signals.Interrupted(exc.sigval) from None
    except ChildFailedError as exc:  # the ranks saw the signal first (a terminal's Ctrl-C reaches them all)
        codes = {signals.interrupt_code(f.exitcode) for f in exc.failures.values()}
        if len(codes) == 1 and None not in codes:
            raise signals.Interrupted(codes.pop()) from None
        raise


def unreported(exc) -> str | None:
    """Why ranks failed without printing their own `error:` line (killed, crashed), or None if each printed it."""
    odd = {r: f.exitcode for r, f in exc.failures.items() if f.exitcode != 1}
    return f"ranks {sorted(odd)} died (exit codes {odd}); every rank was stopped" if odd else None


def spawn(job: dict, nproc: int) -> None:
    """A single run on `nproc` ranks started here; a failed rank fails the job."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from k3dist.run.job import rank_entry

    try:
        launch_ranks(job, nproc, rank_entry)
    except ChildFailedError as exc:
        if unreported(exc):
            raise K3Error(unreported(exc)) from None
        sys.exit(1)


def sweep_point(job: dict) -> None:
    """One point of a sweep (`-m`). Its ranks run in processes of their own even for dist.nproc=1, so a failure,
    peak memory or process group never leaks into the next point; a refusal or error is recorded in the job dir
    (k3dist/run/sweep.py) and the sweep goes on."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from k3dist.run.sweep import point_rank, write_point

    if under_torchrun():
        raise K3Error("a sweep (-m) starts each point's ranks itself: run python launch.py -m ... dist.nproc=N")
    hc = HydraConfig.get()
    record = partial(write_point, Path(hc.runtime.output_dir), hc.job.num, list(hc.overrides.task), job["out"])
    try:
        peaks = launch_ranks(job, int(job["dist"]["nproc"]), point_rank)
    except ChildFailedError as exc:
        error = unreported(exc)
        if error:
            print(K3Error(error).line, file=sys.stderr)
        else:  # every rank printed its error line; point_rank also left it in torch elastic's error file
            message = exc.get_first_failure()[1].message
            error = (message["message"] if isinstance(message, dict) else message).removeprefix("K3Error: ")
        record(error=error)
    else:
        record(peaks=[peaks[rank] for rank in sorted(peaks)])


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    job = OmegaConf.to_container(cfg, resolve=True)
    hc = HydraConfig.get()
    if job.get("out") is None:
        job["out"] = str(Path(hc.runtime.output_dir) / "result.json")
    from k3dist.settings import parse  # imports torch: here, once `__main__` below has set up signal handling

    try:
        nproc = parse(job).dist.nproc  # every override checked here: a bad value is one `error:` line
        if hc.mode == RunMode.MULTIRUN:
            sweep_point(job)
        elif under_torchrun() or nproc == 1:
            from torch.distributed.elastic.multiprocessing.errors import record

            from k3dist.run.job import run_or_exit

            signals.as_rank(announce=rank_zero())  # this process is the rank: it ends even mid-collective
            record(run_or_exit)(job)
        else:
            spawn(job, nproc)
    except K3Error as exc:
        from k3dist.base.failures import exit_with_error

        exit_with_error(exc)
    except Exception as exc:  # noqa: BLE001 - the launcher's own failure: one line too, never a traceback
        from k3dist.base.failures import exit_with_error, unexpected

        exit_with_error(unexpected(exc))


if __name__ == "__main__":
    threads.configure_openmp()  # before torch loads libgomp; spawned ranks inherit it, torchrun's workers run this
    allocator.configure_caches()  # before the first GEMM, likewise
    signals.as_launcher(announce=rank_zero())  # before torch is imported: one line at any point, no traceback
    if not rank_zero():
        sys.argv += QUIET_RANK_OVERRIDES
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")  # Hydra raises instead of printing: composition errors below
    try:
        main()
    except (HydraException, OmegaConfBaseException) as exc:  # unknown key, group option or bad override syntax
        print(K3Error(f"bad config or override: {exc}").line, file=sys.stderr)
        sys.exit(1)
    except signals.Interrupted as exc:  # every rank has ended: a sweep's summary of its finished points, the line
        signals.report(exc.signum)
        logging.disable()  # the line is the last word: no library's exit-time logging (torch's cache stats) after it
        sys.exit(exc.code)
elif __name__ == "__mp_main__":  # a rank launch_ranks spawned, importing this file before its entry runs
    signals.as_rank(announce=False)  # its launcher prints the line
