"""``python tests/gcs_server.py PORT``: the local GCS server of the package
(`replicator.runtime.gcs_server`: gcp-storage-emulator with the parts of the GCS
JSON API that tensorstore needs), in memory, on 127.0.0.1:PORT."""

from __future__ import annotations

import sys

from replicator.runtime.gcs_server import READ_ONLY as READ_ONLY
from replicator.runtime.gcs_server import serve

if __name__ == "__main__":
    serve(int(sys.argv[1]))
