"""One lock per process for device-wide work.

Each engine captures its CUDA graphs on its own loop thread. A device-wide
call made meanwhile on another thread (synchronising the device, returning
cached memory to the driver) breaks that capture, whichever capture mode is
used. Engines in one process (several on one GPU, or one being shut down
while the next one starts) take this lock around both: a capture and those
calls never overlap."""
from __future__ import annotations

import threading

DEVICE_WIDE = threading.RLock()
