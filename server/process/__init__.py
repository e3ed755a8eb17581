"""Start-up and the processes: `pollen serve`'s checks and the server's start (app.py), the
supervisor that starts and restarts the children (supervisor.py), a frontend process's wiring
(frontend.py), the listening addresses (address.py) and the served models' resolution
(served_model.py). May import every other part of server/: it is what wires them.
"""
