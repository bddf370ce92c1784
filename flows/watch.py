"""Follow a flow run on the terminal: its log lines as they reach the API, then its final state and, when it
did not complete, why (the state's message: the flow's error).

`prefect deployment run --watch` prints nothing while the run runs and only the state's name at its end
("Flow run finished in state 'Failed'."), the reason being in the worker's log; `scripts/prefect_local.sh
run` (`make demo`, `make default-run`) follows its run with this instead:

    python -m kvcompress_flows.watch FLOW_RUN_ID     # exit 0 when it completed, 1 otherwise
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from uuid import UUID

POLL_S = 2.0
LATE_S = 30.0  # log lines reach the API in batches: look this far back for lines not yet seen


def follow(flow_run_id: str, out=sys.stdout) -> bool:
    """Print the flow run's log lines until it ends, then its final state; whether it completed."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId, LogFilterTimestamp
    from prefect.client.schemas.sorting import LogSort

    seen: set[UUID] = set()
    since = None
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(UUID(flow_run_id))
        reads_after_end = 2  # the run's process sends its last lines as it exits, after its final state
        while reads_after_end:
            if run.state is not None and run.state.is_final():
                reads_after_end -= 1
            after = LogFilterTimestamp(after_=since - timedelta(seconds=LATE_S)) if since else None
            for log in client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id]), timestamp=after),
                                        sort=LogSort.TIMESTAMP_ASC, limit=200):
                if log.id not in seen:
                    seen.add(log.id)
                    since = log.timestamp if since is None else max(since, log.timestamp)
                    print(f"{log.timestamp.astimezone():%H:%M:%S} {log.message}", file=out, flush=True)
            time.sleep(POLL_S)
            run = client.read_flow_run(run.id)
    state = run.state
    if state.is_completed():
        print(f"flow run {run.name}: {state.name}", file=out, flush=True)
        return True
    print(f"flow run {run.name} ended {state.name}: {state.message or 'no message'}", file=out, flush=True)
    return False


if __name__ == "__main__":
    sys.exit(0 if follow(sys.argv[1]) else 1)
