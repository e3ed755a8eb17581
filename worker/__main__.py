"""`python -m pollen.worker '<WorkerConfig as JSON>'`: one worker process (see pollen.worker.main)."""
import sys

from pollen.worker.main import main

sys.exit(main())
