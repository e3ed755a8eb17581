"""SIGTERM with the HTTP door open: a request in flight is answered, idle keep-alive connections do
not hold the server up, and the process exits 0."""
from __future__ import annotations

import http.client
import json
import threading
import time

from tests.conftest import ServerProcess, shm_segments


def test_sigterm_answers_the_request_in_flight_then_exits():
    srv = ServerProcess().start()
    try:
        idle = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=30)
        idle.request("GET", "/health")
        assert idle.getresponse().read() == b'{"status":"SERVING"}'  # now idle, kept alive

        result = {}

        def long_request():
            conn = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=60)
            body = {"input": [f"passage {i}: " + "words that make a long text " * 40 for i in range(64)],
                    "truncate": "end"}
            conn.request("POST", "/v1/embeddings", body=json.dumps(body))
            reply = conn.getresponse()
            result.update(status=reply.status, connection=reply.getheader("Connection"),
                          rows=len(json.loads(reply.read())["data"]))

        worker = threading.Thread(target=long_request)
        worker.start()
        time.sleep(0.5)  # let the request reach the server (64 x 256 tokens take seconds on 2 cores)
        assert srv.terminate(timeout=30) == 0
        worker.join()
        assert result == {"status": 200, "connection": "close", "rows": 64}
        assert shm_segments(srv.pid) == []
    finally:
        srv.kill()
