"""``python -m router``: one router replica, configured from ``RUDDER_*`` variables."""

from router.app import run

if __name__ == "__main__":
    run()
