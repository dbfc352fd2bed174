"""The Python client of Stackfuse: submit Relax modules, wait for the build, download it.

    import stackfuse

    with stackfuse.Client() as client:              # $STACKFUSE_URL, else the local `serve`
        job = client.submit("model.json", target="sm_90")
        job.wait(progress=print)
        library, report = job.download("out")

No TVM, worker or torch import: it runs wherever httpx does. Errors: :mod:`stackfuse.errors`.
"""

from stackfuse import errors
from stackfuse.client import Client, Downloaded, Job, Page, Progress, default_url
from stackfuse.errors import APIError, JobFailed, StackfuseError

__all__ = [
    "APIError",
    "Client",
    "Downloaded",
    "Job",
    "JobFailed",
    "Page",
    "Progress",
    "StackfuseError",
    "default_url",
    "errors",
]
