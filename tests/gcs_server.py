"""``python tests/gcs_server.py PORT``: gcp-storage-emulator with two parts of the GCS
JSON API it lacks and that tensorstore (Orbax's array writer) relies on.

Orbax writes each checkpoint as an OCDBT database, whose manifest several
writers commit with conditional writes; tensorstore reads objects back with their
generation. Real GCS does both; the emulator (2026.7) ignores ``ifGenerationMatch``
and sends no ``x-goog-generation`` header on a media download, and tensorstore
then stops with "Malformed StorageGeneration" once a checkpoint has more than a
few arrays. This adds, as GCS documents them:

* ``x-goog-generation`` / ``x-goog-metageneration`` on every media download
  (https://cloud.google.com/storage/docs/xml-api/reference-headers);
* the ``ifGenerationMatch`` precondition on media uploads: 412 Precondition
  Failed when the object's generation differs (0: the object must not exist),
  checked and written under one lock so that two writers cannot both win
  (https://cloud.google.com/storage/docs/request-preconditions).

The emulator has no IAM, so one more rule stands in for a bucket the caller may
read but not write: in a bucket whose name starts with ``readonly-``, every
upload and delete is refused with 403 Forbidden and GCS's message for a caller
without the permission (``storage.objects.create`` / ``storage.objects.delete``).

Everything else is the emulator's own server, unchanged.
"""

from __future__ import annotations

import sys
import threading
from http import HTTPStatus

from gcp_storage_emulator import server
from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects

_WRITE = threading.Lock()


def _generation(storage, bucket: str, name: str) -> str:
    try:
        return str(storage.get_file_obj(bucket, name)["generation"])
    except NotFound:
        return "0"


def download(request, response, storage, *args, **kwargs):
    objects_download(request, response, storage, *args, **kwargs)
    try:
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
    except NotFound:
        return
    response["x-goog-generation"] = str(obj["generation"])
    response["x-goog-metageneration"] = str(obj["metageneration"])


READ_ONLY = "readonly-"


def _forbidden(request, response, permission: str) -> bool:
    bucket = request.params.get("bucket_name", "")
    if not bucket.startswith(READ_ONLY):
        return False
    response.status = HTTPStatus.FORBIDDEN
    message = (
        f"tester@example.iam.gserviceaccount.com does not have {permission} access to the "
        f"Google Cloud Storage bucket {bucket}."
    )
    response.json({"error": {"code": 403, "message": message}})
    return True


def delete(request, response, storage, *args, **kwargs):
    if not _forbidden(request, response, "storage.objects.delete"):
        objects_delete(request, response, storage, *args, **kwargs)


def insert(request, response, storage, *args, **kwargs):
    if _forbidden(request, response, "storage.objects.create"):
        return
    wanted = request.query.get("ifGenerationMatch")
    name = request.query.get("name")
    with _WRITE:
        if wanted and name:
            current = _generation(storage, request.params["bucket_name"], name[0])
            if current != wanted[0]:
                response.status = HTTPStatus.PRECONDITION_FAILED
                response.json({"error": {"code": 412, "message": "Precondition Failed"}})
                return
        objects_insert(request, response, storage, *args, **kwargs)


objects_download, objects_insert, objects_delete = objects.download, objects.insert, objects.delete
_OURS = {objects_download: download, objects_insert: insert, objects_delete: delete}
for _, handlers in server.HANDLERS:
    for method, handler in list(handlers.items()):
        if handler in _OURS:
            handlers[method] = _OURS[handler]
objects.insert = insert  # the server's fallback for uploads posted without /upload
objects.download = download  # what a GET of .../o/NAME?alt=media calls through objects.get


if __name__ == "__main__":
    port = int(sys.argv[1])
    gcs = server.create_server("127.0.0.1", port, in_memory=True)
    gcs.start()
    threading.Event().wait()
