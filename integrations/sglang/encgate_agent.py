"""Stage an sglang encoder's embeddings with the node's encgate agent.

The encgate gpuagent holds the embeddings this node's encoder produced and
performs sglang's Mooncake ``/send`` transfers for them. The encoder hands
each part to the agent over the agent's Unix socket (``control.socket``,
default ``/run/encgate/agent.sock``): HTTP/1.1 requests, one connection each.
The agent learns which process staged a part from the kernel (peer
credentials): that process alone may stage its embedding, ack frame or
failure afterwards; any other gets HTTP 409.

For every part (req_id) an encoder must, in this order:

1. stage the embedding, or record that the encode failed::

       agent = Agent()
       try:
           tensor = encode(...)                      # [tokens, dim]
           agent.stage_tensor(req_id, tensor)        # or stage_cuda / stage_bytes / stage_memfd / stage_fd
       except Exception as err:
           agent.fail(req_id, str(err))

2. stage the ack frame: the pickled EmbeddingData *without* its tensor, the
   exact bytes sglang's receiver expects on its PULL socket once the bytes
   arrived (the agent pushes them after each confirmed transfer)::

       agent.stage_ack(req_id, pickle.dumps(embedding_data_without_tensor))

3. only THEN publish the part's metadata (embedding_size, embedding_len,
   embedding_dim, as the stage call returned them), so that no ``/send`` can
   reach the agent before the part and its ack frame are there.

Errors the agent answers raise :class:`AgentError` (``.status`` is the HTTP
status: 400 bad request, 408 stalled body, 409 already staged / staged by
another process, 413 too large, 503 busy, retry after ``.retry_after``
seconds, 501 stage_cuda on an agent without CUDA, 507 out of staging
capacity). Arguments that are wrong before
anything is sent raise ``ValueError``; a socket that cannot be reached raises
``OSError`` (``FileNotFoundError``, ``PermissionError``, ...), a call that
takes longer than ``timeout`` raises ``TimeoutError`` (``socket.timeout``).

Standard library only; Linux; Python >= 3.9 (``socket.send_fds``).
"""

from __future__ import annotations

import http.client
import json
import operator
import os
import socket
import sys
import urllib.parse
from typing import Any, Dict, Optional, Tuple, Union

if sys.version_info < (3, 9):  # pragma: no cover
    raise ImportError("encgate_agent needs Python >= 3.9 (socket.send_fds)")

__all__ = ["Agent", "AgentError", "DEFAULT_SOCKET", "ELEMENT_SIZES"]

#: The agent's default control.socket.
DEFAULT_SOCKET = "/run/encgate/agent.sock"

#: The dtypes the agent takes, with their element sizes in bytes (torch's
#: names).
ELEMENT_SIZES: Dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

Buffer = Any  # any object supporting the buffer protocol


_cuda: Any = None


def _cuda_driver() -> Any:
    """The CUDA driver library through ctypes, loaded once."""
    global _cuda
    if _cuda is None:
        import ctypes
        lib = ctypes.CDLL(os.environ.get("ENCGATE_CUDA_LIBRARY") or "libcuda.so.1")
        lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
        lib.cuIpcGetMemHandle.argtypes = [ctypes.c_char_p, ctypes.c_uint64]
        lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
        lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
        lib.cuInit.argtypes = [ctypes.c_uint]
        _cuda = lib
    return _cuda


def _cuda_check(lib: Any, call: str, code: int) -> None:
    if code != 0:
        import ctypes
        name = ctypes.c_char_p()
        lib.cuGetErrorName(code, ctypes.byref(name))
        raise OSError("%s failed: %s (%d)" % (call, (name.value or b"?").decode(), code))


def _cuda_export(ptr: int, device: int) -> Tuple[bytes, int]:
    """The IPC handle of the allocation holding ptr, and ptr's offset in it.
    The calling thread's current context is used (PyTorch makes the
    device's primary context current); with none, the device's primary
    context is made current."""
    import ctypes
    lib = _cuda_driver()
    _cuda_check(lib, "cuInit", lib.cuInit(0))
    cur = ctypes.c_void_p()
    _cuda_check(lib, "cuCtxGetCurrent", lib.cuCtxGetCurrent(ctypes.byref(cur)))
    if not cur.value:
        dev = ctypes.c_int()
        _cuda_check(lib, "cuDeviceGet", lib.cuDeviceGet(ctypes.byref(dev), device))
        _cuda_check(lib, "cuDevicePrimaryCtxRetain", lib.cuDevicePrimaryCtxRetain(ctypes.byref(cur), dev))
        _cuda_check(lib, "cuCtxSetCurrent", lib.cuCtxSetCurrent(cur))
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    _cuda_check(lib, "cuMemGetAddressRange", lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr))
    handle = ctypes.create_string_buffer(64)
    _cuda_check(lib, "cuIpcGetMemHandle", lib.cuIpcGetMemHandle(handle, base.value))
    return handle.raw, ptr - base.value


class AgentError(Exception):
    """An error answer from the agent.

    Attributes:
        status: the HTTP status (400, 408, 409, 413, 503, 507, ...).
        message: the agent's message.
        req_id: the req_id the answer names, or None.
        retry_after: seconds to wait before retrying (503), or None.
    """

    def __init__(self, status: int, message: str, req_id: Optional[str] = None,
                 retry_after: Optional[float] = None) -> None:
        super().__init__("encgate agent: %d: %s" % (status, message))
        self.status = status
        self.message = message
        self.req_id = req_id
        self.retry_after = retry_after


def _integer(name: str, value: int, least: int) -> int:
    """value as an int >= least, or ValueError."""
    try:
        n = operator.index(value)
    except TypeError:
        n = None
    if isinstance(value, bool) or n is None or n < least:
        raise ValueError("%s must be an integer >= %d, got %r" % (name, least, value))
    return n


def _check_id(req_id: str) -> str:
    if not isinstance(req_id, str) or not req_id:
        raise ValueError("req_id must be a non-empty string, got %r" % (req_id,))
    return req_id


def _shape(tokens: int, dim: int, dtype: str) -> Tuple[int, int, int]:
    """Checks a stage's shape and dtype; returns tokens, dim and the size
    in bytes."""
    tokens, dim = _integer("tokens", tokens, 1), _integer("dim", dim, 1)
    if dtype not in ELEMENT_SIZES:
        raise ValueError("unsupported dtype %r (want one of %s)" % (dtype, ", ".join(ELEMENT_SIZES)))
    return tokens, dim, tokens * dim * ELEMENT_SIZES[dtype]


def _check_size(req_id: str, view: memoryview, tokens: int, dim: int, dtype: str, want: int) -> None:
    if view.nbytes != want:
        raise ValueError("data has %d bytes, want tokens*dim*element_size = %d*%d*%d = %d for req_id=%s"
                         % (view.nbytes, tokens, dim, ELEMENT_SIZES[dtype], want, req_id))


def _bytes_view(data: Buffer) -> memoryview:
    """A flat byte view of data, without a copy when data is C-contiguous."""
    view = memoryview(data)
    if view.c_contiguous:
        return view.cast("B") if (view.format != "B" or view.ndim != 1) else view
    return memoryview(view.tobytes())  # not contiguous: one copy


class Agent:
    """A client of the encgate agent's Unix socket.

    Each call opens a connection, sends one request, reads the answer and
    closes the connection, so one Agent may be shared by threads.
    """

    def __init__(self, socket_path: str = DEFAULT_SOCKET, timeout: float = 30.0) -> None:
        """socket_path is the agent's control.socket; timeout bounds each
        socket operation of a call (connect, each send, each read), in
        seconds."""
        self.socket_path = socket_path
        self.timeout = timeout

    # -- staging ---------------------------------------------------------

    def stage_bytes(self, req_id: str, data: Buffer, tokens: int, dim: int, dtype: str) -> Dict[str, Any]:
        """Stages data, the embedding of req_id as a C-order [tokens, dim]
        array of dtype, sent as the request body.

        data is any buffer-protocol object (bytes, bytearray, memoryview,
        a numpy array, ...); it is sent without a copy when C-contiguous.
        Its size must be tokens*dim*element_size bytes (ValueError if not,
        before anything is sent).

        Returns the agent's answer: {"req_id", "embedding_size",
        "embedding_len", "embedding_dim"}, the metadata to publish.
        """
        _check_id(req_id)
        tokens, dim, want = _shape(tokens, dim, dtype)
        body = _bytes_view(data)
        _check_size(req_id, body, tokens, dim, dtype, want)
        return self._post("/v1/stage", {"req_id": req_id, "tokens": tokens, "dim": dim, "dtype": dtype}, body)

    def stage_tensor(self, req_id: str, tensor: Any) -> Dict[str, Any]:
        """Stages a 2-D torch tensor [tokens, dim] (on any device) as
        req_id's embedding: copied to host memory, made contiguous, sent as
        bytes with its dtype (torch.bfloat16 is "bfloat16").

        torch is not imported by this module; it is used only here, through
        the tensor given.
        """
        _check_id(req_id)
        if tensor.dim() != 2:
            raise ValueError("want a 2-D tensor [tokens, dim], got shape %s" % (tuple(tensor.shape),))
        dtype = str(tensor.dtype).rpartition(".")[2]  # "torch.bfloat16" -> "bfloat16"
        if dtype not in ELEMENT_SIZES:
            raise ValueError("unsupported tensor dtype %s (want one of %s)" % (tensor.dtype, ", ".join(ELEMENT_SIZES)))
        t = tensor.detach().to("cpu").contiguous()
        tokens, dim = (int(n) for n in t.shape)
        try:
            import torch  # already loaded: tensor is one of its tensors
            data = t.view(torch.uint8).numpy()  # every dtype, bfloat16 and float8 included
        except (ImportError, RuntimeError, TypeError):
            data = t.numpy()
        return self.stage_bytes(req_id, data, tokens, dim, dtype)

    def stage_fd(self, req_id: str, fd: Union[int, Any], tokens: int, dim: int, dtype: str,
                 offset: int = 0) -> Dict[str, Any]:
        """Stages req_id's embedding from a file: fd (a descriptor, or an
        object with fileno()) of a memfd or /dev/shm file open for reading,
        holding the C-order [tokens, dim] array of dtype at offset.

        The descriptor is passed to the agent (SCM_RIGHTS), which maps the
        file read-only and keeps the mapping until the part is released: the
        caller may close fd once this returns, but must not change or
        truncate the file's staged bytes.
        """
        _check_id(req_id)
        tokens, dim, _ = _shape(tokens, dim, dtype)
        fd = _integer("fd", fd.fileno() if hasattr(fd, "fileno") else fd, 0)
        offset = _integer("offset", offset, 0)
        query: Dict[str, Any] = {"req_id": req_id, "tokens": tokens, "dim": dim, "dtype": dtype, "source": "fd"}
        if offset:
            query["offset"] = offset
        return self._post("/v1/stage", query, None, fd=fd)

    def stage_memfd(self, req_id: str, data: Buffer, tokens: int, dim: int, dtype: str) -> Dict[str, Any]:
        """Stages data as stage_bytes does, through a fresh memfd passed to
        the agent instead of the request body (one copy, into the memfd).
        The memfd is closed here; the agent keeps its own mapping."""
        _check_id(req_id)
        tokens, dim, want = _shape(tokens, dim, dtype)
        view = _bytes_view(data)
        _check_size(req_id, view, tokens, dim, dtype, want)
        fd = os.memfd_create("encgate-stage", os.MFD_CLOEXEC)
        try:
            while view:
                n = os.write(fd, view)
                view = view[n:]
            return self.stage_fd(req_id, fd, tokens, dim, dtype)
        finally:
            os.close(fd)

    def stage_cuda(self, req_id: str, tensor: Any) -> Dict[str, Any]:
        """Stages a 2-D CUDA tensor [tokens, dim] as req_id's embedding
        without copying it to host memory: the agent receives a CUDA IPC
        handle for the allocation that holds it, copies the bytes into device
        memory of its own and answers. Once this returns the tensor may be
        freed or reused. A non-contiguous tensor is made contiguous first.

        The work that produced the tensor must be complete before the agent
        copies it: when torch is loaded, the tensor's device's current
        stream is synchronized here first (a tensor written on another
        stream must be synchronized by the caller).

        The handle comes from the CUDA driver (libcuda.so.1, or the library
        $ENCGATE_CUDA_LIBRARY names) through ctypes: cuMemGetAddressRange
        finds the allocation's base, cuIpcGetMemHandle exports it, and the
        offset inside it is sent along. PyTorch's own export
        (``UntypedStorage._share_cuda_``) is not used: it also registers a
        reference count that the consumer is meant to drop when it frees
        its mapping, which the agent, closing the handle before it answers,
        never does, so PyTorch would keep the block forever. An allocation
        CUDA cannot export (PyTorch's expandable segments, cuMemMap) raises
        OSError naming the driver's error; stage_tensor works for those.

        Agents without CUDA answer HTTP 501 (AgentError) naming why.
        """
        _check_id(req_id)
        if not getattr(tensor, "is_cuda", False):
            raise ValueError("stage_cuda wants a CUDA tensor; use stage_tensor for one on %s" % (getattr(tensor, "device", "?"),))
        if tensor.dim() != 2:
            raise ValueError("want a 2-D tensor [tokens, dim], got shape %s" % (tuple(tensor.shape),))
        dtype = str(tensor.dtype).rpartition(".")[2]
        if dtype not in ELEMENT_SIZES:
            raise ValueError("unsupported tensor dtype %s (want one of %s)" % (tensor.dtype, ", ".join(ELEMENT_SIZES)))
        t = tensor if tensor.is_contiguous() else tensor.contiguous()
        device = int(t.device.index or 0)
        torch = sys.modules.get("torch")
        if torch is not None and hasattr(torch, "cuda"):
            torch.cuda.current_stream(t.device).synchronize()
        tokens, dim = (int(n) for n in t.shape)
        handle, offset = _cuda_export(int(t.data_ptr()), device)
        answer = self.stage_cuda_handle(req_id, handle, device, tokens, dim, dtype, offset)
        del t  # kept alive until the agent has copied it
        return answer

    def stage_cuda_handle(self, req_id: str, handle: bytes, device: int, tokens: int, dim: int, dtype: str,
                          offset: int = 0) -> Dict[str, Any]:
        """Stages req_id's embedding from device memory another way
        exported: handle is the 64-byte CUDA IPC memory handle
        (cudaIpcGetMemHandle / cuIpcGetMemHandle) of the allocation on
        device (its ordinal) that holds the C-order [tokens, dim] array of
        dtype at offset bytes. The memory must stay allocated and unchanged
        until this returns."""
        _check_id(req_id)
        tokens, dim, _ = _shape(tokens, dim, dtype)
        if not isinstance(handle, (bytes, bytearray)) or len(handle) != 64:
            raise ValueError("handle must be the 64 bytes of a CUDA IPC memory handle")
        device = _integer("device", device, 0)
        offset = _integer("offset", offset, 0)
        query: Dict[str, Any] = {"req_id": req_id, "tokens": tokens, "dim": dim, "dtype": dtype, "source": "cuda",
                                 "device": device, "handle": bytes(handle).hex()}
        if offset:
            query["offset"] = offset
        return self._post("/v1/stage", query, None)

    def stage_ack(self, req_id: str, frame: bytes) -> Dict[str, Any]:
        """Stages req_id's ack frame: the pickled EmbeddingData without its
        tensor, pushed as-is to sglang's receiver after each confirmed
        transfer. Before or after the embedding, but before the part's
        metadata is published. Returns {"req_id", "ack_frame_bytes"}."""
        _check_id(req_id)
        body = _bytes_view(frame)
        if not body.nbytes:
            raise ValueError("empty ack frame for req_id=%s" % req_id)
        return self._post("/v1/ack", {"req_id": req_id}, body)

    def fail(self, req_id: str, message: str) -> Dict[str, Any]:
        """Records that req_id's encode failed: sglang's /sends for it are
        answered "No embedding available". Returns {"req_id", "error"}."""
        _check_id(req_id)
        if not isinstance(message, str) or not message:
            raise ValueError("message must be a non-empty string")
        return self._post("/v1/stage", {"req_id": req_id, "error": message}, None)

    # -- the wire --------------------------------------------------------

    def _post(self, path: str, query: Dict[str, Any], body: Optional[memoryview],
              fd: Optional[int] = None) -> Dict[str, Any]:
        length = body.nbytes if body is not None else 0
        head = ("POST %s?%s HTTP/1.1\r\nHost: encgate-agent\r\nContent-Type: application/octet-stream\r\n"
                "Content-Length: %d\r\nConnection: close\r\n\r\n"
                % (path, urllib.parse.urlencode(query), length)).encode("ascii")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self.socket_path)
            sent_err: Optional[OSError] = None
            try:
                if fd is None:
                    sock.sendall(head)
                else:
                    # The descriptor must travel with the request's first bytes.
                    n = socket.send_fds(sock, [head], [fd])
                    if n < len(head):
                        sock.sendall(head[n:])
                if length:
                    sock.sendall(body)
            except (BrokenPipeError, ConnectionResetError) as err:
                # The agent may answer (and close) before reading a body it
                # refuses (409, 413, 503, 507): read that answer below.
                sent_err = err
            return self._answer(sock, query.get("req_id"), sent_err)
        finally:
            sock.close()

    @staticmethod
    def _answer(sock: socket.socket, req_id: Optional[str], sent_err: Optional[OSError]) -> Dict[str, Any]:
        resp = http.client.HTTPResponse(sock, method="POST")
        try:
            try:
                resp.begin()
            except (http.client.HTTPException, ConnectionError):
                if sent_err is not None:
                    raise sent_err from None
                raise
            data = resp.read()
            status = resp.status
            retry = resp.getheader("Retry-After")
        finally:
            resp.close()
        if 200 <= status < 300:
            return json.loads(data) if data else {}
        message, rid = data.decode("utf-8", "replace"), req_id
        try:
            env = json.loads(data)
            if isinstance(env, dict):
                message = str(env.get("message", message))
                rid = env.get("req_id", rid)
        except ValueError:
            pass
        retry_after: Optional[float] = None
        if retry is not None:
            try:
                retry_after = float(retry)
            except ValueError:
                pass
        raise AgentError(status, message, rid, retry_after)

