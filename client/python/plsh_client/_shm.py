"""Same-host shared memory for the Python client: a file of the server's
--shm-dir mapped into this process and registered with the server
(Client.shm_region, Client.attend with arrays of it). The RPCs are Client's
(register_shm, unregister_shm, list_shm)."""

import mmap
import os
import secrets
from typing import Optional

import numpy as np


class SharedMemoryRegion:
    """A file in the server's shared-memory directory, mapped into this
    process and registered with the server: numpy arrays made with array()
    live in it, and Client.attend names them instead of sending them (and
    writes out= / lse= arrays of it in place).

        with Client(addr) as c, c.shm_region(nbytes) as region:
            q = region.array((1, 4096, 8, 64), np.float32)
            q[...] = my_q                              # or compute straight into it
            out = region.array((1, 4096, 8, 64), np.float32)
            c.attend(q, k_region_array, v_region_array, out=out)

    The file is created with mode 0600 (the server takes only files of its own
    user that others cannot write: run both as one user) and removed by
    close(), which also unregisters the region."""

    def __init__(self, client, size, name=None, dir="/dev/shm"):
        self.key = f"plsh-py-{os.getpid()}-{secrets.token_hex(8)}"
        self.name = name or self.key
        self.size = int(size)
        self._client = client
        self._path = os.path.join(dir, self.key)
        self._next = 0
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.posix_fallocate(fd, 0, self.size)  # on tmpfs: the pages now, not SIGBUS later
            self._map = mmap.mmap(fd, self.size)
        except BaseException:
            os.unlink(self._path)
            raise
        finally:
            os.close(fd)
        self._bytes: Optional[np.ndarray] = np.frombuffer(self._map, np.uint8)
        self.address = self._bytes.__array_interface__["data"][0]
        try:
            client.register_shm(self.name, self.key, 0, self.size)
        except BaseException:
            self._release()
            raise
        client._regions.append(self)

    def array(self, shape, dtype, offset=None):
        """A C-contiguous array of the region: at `offset` bytes, or after
        the last one made (each at a 4 KiB boundary)."""
        dtype = np.dtype(dtype)
        count = int(np.prod(shape))
        if offset is None:
            offset = self._next
        if offset < 0 or offset % dtype.itemsize or offset + count * dtype.itemsize > self.size:
            raise ValueError(f"offset {offset} with {count * dtype.itemsize} bytes does not fit the region's "
                             f"{self.size} bytes at a multiple of {dtype.itemsize}")
        self._next = max(self._next, -(-(offset + count * dtype.itemsize) // 4096) * 4096)
        if self._bytes is None:
            raise ValueError(f"region {self.name!r} is closed")
        return self._bytes[offset:offset + count * dtype.itemsize].view(dtype).reshape(shape)

    def close(self):
        """Unregisters the region, unmaps and removes the file."""
        if self._client is None:
            return
        client, self._client = self._client, None
        try:
            client.unregister_shm(self.name)
        finally:
            self._release()

    def _release(self):
        self._bytes = None
        try:
            self._map.close()
        except BufferError:  # arrays of it still exist: unmapped when they go
            pass
        os.unlink(self._path)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
