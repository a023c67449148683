"""`python -m dtjob.trainer` (also `dtjob train`): one worker of a distributed training job.

Exit status (dtjob.contract): 0 training complete; 75 stopped on SIGTERM/SIGINT after writing a
checkpoint; 2 bad flags, environment, device or user code, or the master unreachable (one line on
stderr names the problem); 3 this worker's DTJOB_GENERATION differs from its gang's; 1 any other
failure, such as a peer lost mid-step (the collective fails within --collective-timeout).
"""

from __future__ import annotations

import logging
import os
import sys
import traceback

from dtjob import contract
from dtjob.trainer.config import EXIT_CONFIG_ERROR, ConfigError, TrainerConfig, parse

EXIT_FAILURE = contract.EXIT_FAILURE
EXIT_STALE_GENERATION = contract.EXIT_STALE_GENERATION


def _fail(code: int, message: str) -> int:
    """Print one line and leave at once: background communication threads must not delay exit."""
    print(f"dtjob-trainer: error: {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)


def _setup_logging(c: TrainerConfig) -> None:
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format=f"dtjob-trainer[rank {c.rank}] %(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse(sys.argv[1:] if argv is None else argv)
    except ConfigError as err:
        print(f"dtjob-trainer: error: {err}", file=sys.stderr, flush=True)
        return EXIT_CONFIG_ERROR
    _setup_logging(config)

    # Imported only now: torch takes seconds to import, and a bad flag should not wait for it.
    from dtjob.trainer.checkpoint import CheckpointError
    from dtjob.trainer.device import DeviceError
    from dtjob.trainer.elastic import RendezvousError, StaleGenerationError
    from dtjob.trainer.loop import train
    from dtjob.trainer.session import SessionError, Stopped

    try:
        train(config)
    except Stopped:
        return contract.EXIT_STOPPED
    except (ConfigError, RendezvousError, DeviceError, SessionError) as err:
        return _fail(EXIT_CONFIG_ERROR, str(err))
    except StaleGenerationError as err:
        return _fail(EXIT_STALE_GENERATION, str(err))
    except CheckpointError as err:
        return _fail(EXIT_FAILURE, f"checkpoint: {err}")
    except Exception as err:
        traceback.print_exc()
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        return _fail(EXIT_FAILURE, f"rank {config.rank} failed: {type(err).__name__}: {first_line}")
    return contract.EXIT_OK


def _exit_now(code: int) -> None:
    """Leave without interpreter finalization: tearing torch's modules down costs about a second of
    CPU per process (several on a loaded machine), and nothing is left to write once main() returned
    (the JSON log is closed, checkpoints are fsynced)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit_now(main())
