"""`python tests/faulty_server.py serve ...`: the server CLI with a fault in the engine's step, for the failure-path
tests (test_reliability_fault.py). The product has no fault hook: this script wraps LLMEngine.launch (every step is
launched, in both pipeline modes) so that it raises once FAULT_AFTER_STEPS steps have run.

The wrap is installed when the module runs as the main script: with --engine-process the engine runs in a process
started by multiprocessing's spawn, which runs the parent's main script as __mp_main__ before the engine, so the
engine process gets the same fault."""

import os
import sys

from asyncengine.engine import LLMEngine

FAULT_ENV = "FAULT_AFTER_STEPS"


def install_fault(after_steps: int) -> None:
    """Make every LLMEngine's launch raise RuntimeError once `after_steps` steps have been launched."""
    launch = LLMEngine.launch

    def faulty_launch(self, step):
        self.launches_before_fault = getattr(self, "launches_before_fault", 0) + 1
        if self.launches_before_fault > after_steps:
            raise RuntimeError(f"injected engine fault after {after_steps} steps ({FAULT_ENV})")
        return launch(self, step)

    LLMEngine.launch = faulty_launch


if __name__ in ("__main__", "__mp_main__"):  # the server, or the engine process spawned by it (not an import)
    install_fault(int(os.environ[FAULT_ENV]))

if __name__ == "__main__":
    from asyncengine.api.cli import main

    sys.exit(main())
