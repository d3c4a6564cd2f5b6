#!/usr/bin/env python3
"""Soak test for visor (issue 14, hardening): mixed load with injected faults
against the release binary, on loopback only.

    python3 scripts/soak.py                 # 10 minutes (builds target/release/visor first)
    python3 scripts/soak.py --seconds 60    # a short run to try it
    python3 scripts/soak.py --help

What runs (all on 127.0.0.1, ports chosen free):

* a mock upstream (HTTP/1.1, keep-alive) answering /v1/chat/completions as
  JSON or as SSE (OpenAI chunks, `data: [DONE]`), each answer derived from
  its request: "ECHO <nonce> hdr=.. img=.. hist=..", the nonce taken from the
  last user message. It injects faults a request asks for in `x-soak-fault`:
  `head` (socket closed, sometimes reset, before the response head), `mid`
  (closed in the middle of the body), `stall` (silent past visor's idle
  deadline), `slowhead` (head later than the first-byte deadline), `500`.
  It also plays the describer model (slow: 1-2.5 s, a quarter 4-6 s, past
  describer.timeout_secs = 3) and checks what visor sent: no image left for
  the text-only model, the description that of the right image, the previous
  turn of a session present in the history, no document bytes (base64 of
  `%PDF-` or `PK\x03\x04`, `file_data`) but each document's one line of text
  in their place, an amplifying spreadsheet's text cut and the whole body
  within server.max_body_bytes (2 MiB here);
* on the same port, a WebSocket upstream (RFC 6455 by hand: handshake,
  masked client frames, text/close/ping/pong, fragments) for the Responses
  WebSocket mode: each `response.create` answered `response.created`,
  `response.output_text.delta`s, `response.completed` with usage, every event
  carrying the request's nonce; the same checks on its input (image, files)
  as for HTTP. Faults asked in the event's `metadata.soak_fault`: `error`
  (an `error` event), `cut` (TCP closed mid-response), `closeframe` (close
  1011 mid-response), `stall` (silent past the idle deadline), `slow` (0.5 s
  between deltas: must complete); and in the handshake's `x-soak-ws-fault`:
  `refuse` (401, to be passed back) and `head` (closed before the 101: 502);
* visor A: `[store] backend = "redis://…"` on a redis-server this script
  starts (`--save '' --appendonly no`); a few times in the run Redis is
  stopped (`SHUTDOWN SAVE`, so what it held comes back) for ~20 s and started
  again, once frozen (SIGSTOP) for ~20 s instead;
* visor B: the disk store, its data_dir on an 8 MB tmpfs this script mounts,
  filled to the last byte by a filler file every ~90 s and freed ~15 s later;
* 8 workers sending plain chat (JSON, SSE), session turns (x-visor-session),
  images to a text-only model (gpt-oss-120b) and to a vision model,
  documents to the text-only model (a ~450-byte PDF written by hand, a DOCX
  or XLSX zipped here, each with one line of text; or a PDF then one or two
  amplifying XLSX: one 10,000-character shared string in 20,000 cells, ~4 KB
  of zip, 200 million characters if read out whole), /healthz, /readyz,
  /metrics, bad inputs, and WebSocket sockets (`GET /v1/responses`, 2-6
  `response.create` in turn: text, images to the text-only and the vision
  model, PDF/DOCX/XLSX `input_file`s, slow answers, some naming no model so
  the text-only one is carried from the event before; other events echoed
  and pings between; closed with 1000 and its reply; some left after the
  first delta, by a close frame or by dropping the connection), to both
  instances.

Allowed: 200 in full; for an injected upstream fault 502/504, the upstream's
500, or a 200 cut (never a 200 in full); on a WebSocket, an injected fault
may end the response with an `error` event (the upstream's, for that
request) or close the socket with 1011, nothing else (a completed response,
another close code, a connection dropped without a close frame, an event of
another response are wrong); for a session request while its store is down
or within 10 s after it is back, 503 store_unavailable, or any answer cut,
or the connection closed before a response head (a turn visor could not
store: it withholds the last bytes, and a short answer's whole body).
Everything else is a wrong answer: a 200 with content not for its request, a
status not allowed for the situation, a connection error, a stream cut with
no fault injected and no store down. It counts lost turns (a turn answered
200 in full that GET /visor/sessions/<id> does not hold, user message then
reply, in order), duplicated turns and hangs (30 s bound per request);
samples VmRSS of both visors every 5 s; measures how long session requests
take to succeed after each store recovery; SIGTERMs both visors at the end
(exit 0 within the drain timeout). Output, visor logs and every wrong answer
go to target/soak/<run>/. Exit status 0 only if all of it held.

Python 3.11 standard library only. Needs root (tmpfs) and redis-server.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
import traceback
import zipfile
import io
import zlib
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
REQUEST_BOUND = 30.0  # seconds: a request not done by then is a hang
NONVISION_MODEL = "gpt-oss-120b"  # built-in row gpt-oss*: vision=false
VISION_MODEL = "gpt-4o-mini"
TEXT_MODEL = "gpt-4o-mini"
DESCRIBER_MODEL = "soak-describer"
DESCRIBER_TIMEOUT = 3
IDLE_TIMEOUT = 3
FIRST_BYTE_TIMEOUT = 6
DRAIN_DELAY = 2
DRAIN_TIMEOUT = 10
RECOVERY_GRACE = 10.0  # seconds after a store is back in which 503 / cut are still allowed
RECOVERY_LIMIT = 10.0  # a session request must succeed within this after recovery
TURNS_PER_SESSION = 40  # rotate session ids well below max_depth
MAX_BODY_BYTES = 2 << 20  # server.max_body_bytes of both visors: documents' text must fit in it
NONCE_RE = re.compile(r"N:([0-9a-f]{16})")
ECHO_RE = re.compile(r"^ECHO ([0-9a-f]{16}) hdr=(\w+) img=(\w+) hist=(\w+) doc=(\w+)$")
WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
WS_MAX_MESSAGE = 8 << 20

T0 = time.monotonic()


def now() -> float:
    return time.monotonic() - T0


def log(msg: str) -> None:
    print(f"[{now():7.1f}s] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def nonce() -> str:
    return os.urandom(8).hex()


# ---------------------------------------------------------------- images


def png(width: int, height: int, seed: bytes) -> bytes:
    """A valid RGB PNG whose pixels come from `seed` (distinct seeds, distinct images)."""
    rows = []
    stream = hashlib.shake_256(seed).digest(width * height * 3)
    for y in range(height):
        rows.append(b"\x00" + stream[y * width * 3 : (y + 1) * width * 3])
    raw = b"".join(rows)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw, 1)) + chunk(b"IEND", b"")


@dataclass
class Image:
    data: bytes
    sha: str
    b64: str
    w: int
    h: int


def make_image(big: bool = False) -> Image:
    if big:
        w, h = 320, 320  # ~300 KB of noise: bodies over 256 KiB go to visor's blocking pool
    else:
        w, h = random.randint(4, 24), random.randint(4, 24)
    data = png(w, h, os.urandom(16))
    return Image(data, hashlib.sha256(data).hexdigest(), base64.b64encode(data).decode(), w, h)


# ---------------------------------------------------------------- documents


@dataclass
class Doc:
    data: bytes
    mime: str
    filename: str
    needle: str  # text the model must be sent in its place: its one line, or the amplifying string's start
    amplified: bool = False

    def data_url(self) -> str:
        return f"data:{self.mime};base64," + base64.b64encode(self.data).decode()


PDF_MIME = "application/pdf"
DOCX_MIME = "application/vnd.openxmlformats-officedocument.wordprocessingml.document"
XLSX_MIME = "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet"
# What a document's first bytes look like in base64 (%PDF-, PK\x03\x04): never to reach the text-only model.
DOC_B64_PREFIXES = ("JVBERi0", "UEsDB")


def make_pdf(line: str) -> bytes:
    """A minimal valid PDF: one page, one line of Helvetica text (~450 bytes)."""
    content = f"BT /F1 14 Tf 20 50 Td ({line}) Tj ET".encode()
    objs = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 400 100] /Resources << /Font << /F1 4 0 R >> >> /Contents 5 0 R >>",
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /Encoding /WinAnsiEncoding >>",
        b"<< /Length %d >>\nstream\n%s\nendstream" % (len(content), content),
    ]
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for i, o in enumerate(objs, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (i, o)
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objs) + 1)
    for off in offsets:
        out += b"%010d 00000 n \n" % off
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objs) + 1, xref)
    return bytes(out)


def _zip(parts: list[tuple[str, str]]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        for name, text in parts:
            z.writestr(name, text)
    return buf.getvalue()


_CT = '<?xml version="1.0" encoding="UTF-8"?><Types xmlns="http://schemas.openxmlformats.org/package/2006/content-types"><Default Extension="rels" ContentType="application/vnd.openxmlformats-package.relationships+xml"/><Default Extension="xml" ContentType="application/xml"/>'
_REL = '<?xml version="1.0" encoding="UTF-8"?><Relationships xmlns="http://schemas.openxmlformats.org/package/2006/relationships">'
_R_OFFICE = "http://schemas.openxmlformats.org/officeDocument/2006/relationships"


def make_docx(line: str) -> bytes:
    return _zip([
        ("[Content_Types].xml", _CT + '<Override PartName="/word/document.xml" ContentType="application/vnd.openxmlformats-officedocument.wordprocessingml.document.main+xml"/></Types>'),
        ("_rels/.rels", _REL + f'<Relationship Id="rId1" Type="{_R_OFFICE}/officeDocument" Target="word/document.xml"/></Relationships>'),
        ("word/document.xml", '<?xml version="1.0" encoding="UTF-8" standalone="yes"?><w:document xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main"><w:body>'
         f'<w:p><w:r><w:t>{line}</w:t></w:r></w:p></w:body></w:document>'),
    ])


def make_xlsx(shared: str, cells: int) -> bytes:
    """A spreadsheet whose one shared string is shown in `cells` cells (100 to a row)."""
    rows = []
    for row in range((cells + 99) // 100):
        rows.append(f'<row r="{row + 1}">' + '<c t="s"><v>0</v></c>' * min(100, cells - row * 100) + "</row>")
    sheet = ('<?xml version="1.0" encoding="UTF-8" standalone="yes"?><worksheet xmlns="http://schemas.openxmlformats.org/spreadsheetml/2006/main"><sheetData>'
             + "".join(rows) + "</sheetData></worksheet>")
    return _zip([
        ("[Content_Types].xml", _CT + '<Override PartName="/xl/workbook.xml" ContentType="application/vnd.openxmlformats-officedocument.spreadsheetml.sheet.main+xml"/>'
         '<Override PartName="/xl/worksheets/sheet1.xml" ContentType="application/vnd.openxmlformats-officedocument.spreadsheetml.worksheet+xml"/>'
         '<Override PartName="/xl/sharedStrings.xml" ContentType="application/vnd.openxmlformats-officedocument.spreadsheetml.sharedStrings+xml"/></Types>'),
        ("_rels/.rels", _REL + f'<Relationship Id="rId1" Type="{_R_OFFICE}/officeDocument" Target="xl/workbook.xml"/></Relationships>'),
        ("xl/workbook.xml", f'<?xml version="1.0" encoding="UTF-8"?><workbook xmlns="http://schemas.openxmlformats.org/spreadsheetml/2006/main" xmlns:r="{_R_OFFICE}"><sheets><sheet name="Data" sheetId="1" r:id="rId1"/></sheets></workbook>'),
        ("xl/_rels/workbook.xml.rels", _REL + f'<Relationship Id="rId1" Type="{_R_OFFICE}/worksheet" Target="worksheets/sheet1.xml"/>'
         f'<Relationship Id="rId2" Type="{_R_OFFICE}/sharedStrings" Target="sharedStrings.xml"/></Relationships>'),
        ("xl/sharedStrings.xml", f'<?xml version="1.0" encoding="UTF-8"?><sst xmlns="http://schemas.openxmlformats.org/spreadsheetml/2006/main" count="{cells}" uniqueCount="1"><si><t>{shared}</t></si></sst>'),
        ("xl/worksheets/sheet1.xml", sheet),
    ])


def make_doc(kind: str, marker: str | None = None) -> Doc:
    """`pdf`, `docx`, `xlsx`: one line `SOAKDOC<marker>`; `amplified`: one 10,000-character shared
    string in 20,000 cells (200 million characters if read out whole, ~4 KB of zip)."""
    if kind == "amplified":
        salt = "AMP" + (marker or nonce())
        return Doc(make_xlsx(salt + "x" * (10_000 - len(salt)), 20_000), XLSX_MIME, "amplified.xlsx", salt, True)
    marker = marker or nonce()
    line = f"SOAKDOC{marker}"
    if kind == "pdf":
        return Doc(make_pdf(line), PDF_MIME, f"r{marker[:4]}.pdf", line)
    if kind == "docx":
        return Doc(make_docx(line), DOCX_MIME, f"r{marker[:4]}.docx", line)
    return Doc(make_xlsx(line, 3), XLSX_MIME, f"r{marker[:4]}.xlsx", line)


# ---------------------------------------------------------------- WebSocket framing (RFC 6455)


class WsError(Exception):
    pass


def ws_accept(key: str) -> str:
    return base64.b64encode(hashlib.sha1((key + WS_GUID).encode()).digest()).decode()


def ws_mask(data: bytes, key: bytes) -> bytes:
    n = len(data)
    if n == 0:
        return data
    k = (key * (n // 4 + 1))[:n]
    return (int.from_bytes(data, "big") ^ int.from_bytes(k, "big")).to_bytes(n, "big")


def ws_frame(opcode: int, payload: bytes, mask: bool) -> bytes:
    n = len(payload)
    mbit = 0x80 if mask else 0
    if n < 126:
        head = struct.pack("!BB", 0x80 | opcode, mbit | n)
    elif n < 65536:
        head = struct.pack("!BBH", 0x80 | opcode, mbit | 126, n)
    else:
        head = struct.pack("!BBQ", 0x80 | opcode, mbit | 127, n)
    if mask:
        key = os.urandom(4)
        return head + key + ws_mask(payload, key)
    return head + payload


def ws_close_payload(code: int, reason: str = "") -> bytes:
    return struct.pack("!H", code) + reason.encode()[:100]


async def ws_read_frame(reader: asyncio.StreamReader, want_masked: bool) -> tuple[bool, int, bytes]:
    """(fin, opcode, payload) of one frame; WsError when it breaks the RFC for this side."""
    h = await reader.readexactly(2)
    fin, rsv, opcode = bool(h[0] & 0x80), h[0] & 0x70, h[0] & 0x0F
    masked, n = bool(h[1] & 0x80), h[1] & 0x7F
    if n == 126:
        n = struct.unpack("!H", await reader.readexactly(2))[0]
    elif n == 127:
        n = struct.unpack("!Q", await reader.readexactly(8))[0]
    if rsv:
        raise WsError(f"reserved bits set ({rsv:#x})")
    if masked != want_masked:
        raise WsError("a masked frame from the server" if masked else "an unmasked frame from the client")
    if opcode >= 8 and (n > 125 or not fin):
        raise WsError("a control frame fragmented or over 125 bytes")
    if opcode not in (0, 1, 2, 8, 9, 10):
        raise WsError(f"unknown opcode {opcode}")
    if n > WS_MAX_MESSAGE:
        raise WsError(f"frame of {n} bytes")
    key = await reader.readexactly(4) if masked else b""
    payload = await reader.readexactly(n)
    return fin, opcode, (ws_mask(payload, key) if masked else payload)


@dataclass
class WsMessage:
    kind: str  # text, binary, close
    data: bytes = b""
    code: int | None = None  # close code (None: a close frame with no code)
    reason: str = ""


async def ws_read_message(reader, writer, *, is_client: bool, pongs: list | None = None) -> WsMessage:
    """The next data message or close frame; pings answered, pongs noted, fragments joined."""
    parts: list[bytes] = []
    first = None
    for _ in range(100_000):
        fin, op, payload = await ws_read_frame(reader, want_masked=not is_client)
        if op == 9:
            writer.write(ws_frame(10, payload, mask=is_client))
            await writer.drain()
            continue
        if op == 10:
            if pongs is not None:
                pongs.append(payload)
            continue
        if op == 8:
            if len(payload) == 1:
                raise WsError("a close frame with a 1-byte body")
            code = struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else None
            try:
                reason = payload[2:].decode()
            except UnicodeDecodeError:
                raise WsError("a close reason not in UTF-8")
            return WsMessage("close", payload, code, reason)
        if op == 0:
            if first is None:
                raise WsError("a continuation frame with no message started")
        else:
            if first is not None:
                raise WsError("a new message inside a fragmented one")
            first = op
        parts.append(payload)
        if sum(map(len, parts)) > WS_MAX_MESSAGE:
            raise WsError("message too long")
        if fin:
            data = b"".join(parts)
            if first == 1:
                try:
                    data.decode()
                except UnicodeDecodeError:
                    raise WsError("a text message not in UTF-8")
                return WsMessage("text", data)
            return WsMessage("binary", data)
    raise WsError("too many frames")


# ---------------------------------------------------------------- mock upstream


class Mock:
    """The upstream and the describer, in a thread of its own with its own loop."""

    def __init__(self) -> None:
        self.port = free_port()
        self.stats: Counter = Counter()
        self.describer_inflight = 0
        self.describer_max_inflight = 0
        self.problems: list[str] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, name="mock", daemon=True)

    def start(self) -> None:
        self.thread.start()
        if not self.ready.wait(10):
            raise RuntimeError("mock upstream did not start")

    def stop(self) -> None:
        if self.loop and self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(
            asyncio.start_server(self._conn, HOST, self.port, limit=1 << 20, backlog=512)
        )
        self.ready.set()
        try:
            self.loop.run_forever()
        finally:
            server.close()
            for t in asyncio.all_tasks(self.loop):
                t.cancel()
            self.loop.run_until_complete(asyncio.sleep(0))
            self.loop.close()

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            for _ in range(100_000):  # keep-alive, bounded
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        k, v = line.split(":", 1)
                        headers[k.strip().lower()] = v.strip()
                if method == "GET" and "websocket" in headers.get("upgrade", "").lower():
                    await self._ws(path, headers, reader, writer)
                    return
                body = b""
                if headers.get("transfer-encoding", "").lower() == "chunked":
                    parts = []
                    while True:
                        size = int((await reader.readline()).split(b";")[0], 16)
                        if size == 0:
                            while (await reader.readline()) not in (b"\r\n", b""):
                                pass
                            break
                        parts.append((await reader.readexactly(size + 2))[:-2])
                    body = b"".join(parts)
                elif "content-length" in headers:
                    body = await reader.readexactly(int(headers["content-length"]))
                keep = await self._handle(method, path, headers, body, writer)
                if not keep:
                    return
        except (ConnectionError, asyncio.IncompleteReadError, OSError):
            return
        except Exception:  # a bug in the mock: say so, never hide it
            self.problems.append(traceback.format_exc())
        finally:
            try:
                writer.close()
            except Exception:
                pass

    @staticmethod
    def _reset(writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None and random.random() < 0.5:  # half of them a TCP reset
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
        writer.close()

    async def _send(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(data)
        await writer.drain()

    async def _handle(self, method, path, headers, body, writer) -> bool:
        if method != "POST" or not path.endswith("/chat/completions"):
            self.stats["other"] += 1
            msg = b'{"error":{"message":"mock: unknown path"}}'
            await self._send(writer, b"HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(msg), msg))
            return True
        req = json.loads(body)
        model = req.get("model")
        if model == DESCRIBER_MODEL:
            return await self._describer(req, writer)
        self.stats["chat"] += 1
        fault = headers.get("x-soak-fault", "none")
        self.stats["fault:" + fault] += 1
        content = self._answer(req, headers, body)
        stream = bool(req.get("stream"))
        if fault == "head":
            self._reset(writer)
            return False
        if fault == "slowhead":
            await asyncio.sleep(FIRST_BYTE_TIMEOUT + 2)
            self._reset(writer)
            return False
        if fault == "500":
            msg = b'{"error":{"message":"soak injected 500","type":"server_error","code":null}}'
            await self._send(writer, b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(msg), msg))
            return True
        cid = "chatcmpl-" + nonce()
        if not stream:
            out = json.dumps({
                "id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": len(body) // 4, "completion_tokens": 8, "total_tokens": len(body) // 4 + 8},
            }).encode()
            head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(out)
            if fault in ("mid", "stall"):
                await self._send(writer, head + out[: len(out) // 2])
                if fault == "stall":
                    await asyncio.sleep(IDLE_TIMEOUT + 2)
                self._reset(writer)
                return False
            await self._send(writer, head + out)
            return True
        # SSE, chunked
        await self._send(writer, b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n")

        def ev(obj) -> bytes:
            data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
            return b"%x\r\n%s\r\n" % (len(data), data)

        def chunk(delta, finish=None):
            return {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

        pieces = [content[i : i + 12] for i in range(0, len(content), 12)]
        events = [chunk({"role": "assistant", "content": ""})] + [chunk({"content": p}) for p in pieces]
        events.append(chunk({}, "stop"))
        events.append({"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
                       "choices": [], "usage": {"prompt_tokens": len(body) // 4, "completion_tokens": len(pieces), "total_tokens": len(body) // 4 + len(pieces)}})
        pace = 0.15 if fault == "slowstream" else random.choice((0, 0, 0.002, 0.01))
        for i, e in enumerate(events):
            if fault in ("mid", "stall") and i == 2:
                if fault == "stall":
                    await asyncio.sleep(IDLE_TIMEOUT + 2)
                self._reset(writer)
                return False
            await self._send(writer, ev(e))
            if pace:
                await asyncio.sleep(pace)
        await self._send(writer, ev(b"[DONE]") + b"0\r\n\r\n")
        return True

    def _answer(self, req, headers, body: bytes) -> str:
        msgs = req.get("messages") or []
        last_user = None
        for m in reversed(msgs):
            if isinstance(m, dict) and m.get("role") == "user":
                last_user = m
                break
        hist = "na"
        prev = headers.get("x-soak-prev")
        if prev:
            hist = "MISSING"
            for mm in msgs[:-1]:
                if isinstance(mm, dict) and mm.get("role") == "assistant" and isinstance(mm.get("content"), str) \
                        and mm["content"].startswith(f"ECHO {prev} "):
                    hist = "ok"
                    break
        return self._echo(last_user, body.decode("utf-8", "replace"), len(body), headers.get("x-soak-nonce"),
                          headers.get("x-soak-img-sha"), headers.get("x-soak-img-mode"), hist,
                          headers.get("x-soak-doc"), headers.get("x-soak-doc-amp") == "1")

    def _echo(self, last_user, raw: str, body_len: int, claimed, sha, img_mode, hist: str, doc_needles,
              doc_amp: bool) -> str:
        """The answer to a request (Chat message or Responses input item): what the mock found in it."""
        text = ""
        if last_user is not None:
            c = last_user.get("content")
            if isinstance(c, str):
                text = c
            elif isinstance(c, list):
                text = "\n".join(p.get("text", "") for p in c if isinstance(p, dict) and isinstance(p.get("text", ""), str))
        m = NONCE_RE.search(text)
        n = m.group(1) if m else "0" * 16
        hdr = "ok" if claimed == n else "MISMATCH"
        img = "none"
        if sha:
            if img_mode == "keep":
                img = "kept" if self._kept_sha(last_user) == sha else "ALTERED"
            elif "data:image" in raw or ";base64," in raw:
                img = "RAW"
            elif f"sha256:{sha[:12]}" not in text:
                img = "NOSHA"
            elif "described: DESC-" in text:
                img = "described" if f"described: DESC-{sha[:16]} soak image" in text else "WRONGDESC"
            elif "not shown" in text:
                img = "placeholder"
            else:
                img = "UNKNOWN"
        doc = "na"
        if doc_needles is not None:
            self.stats["documents_checked"] += 1
            if any(x in raw for x in DOC_B64_PREFIXES) or "file_data" in raw or ";base64," in raw:
                doc = "RAW"
            elif body_len > MAX_BODY_BYTES:
                doc = "BIG"
            elif any(x not in text for x in doc_needles.split(",")):
                doc = "MISSING"
            elif doc_amp:
                doc = "cut" if "document text cut at" in text else "UNCUT"
            else:
                doc = "read"
            self.stats["upstream_body_max_with_documents"] = max(self.stats["upstream_body_max_with_documents"], body_len)
        return f"ECHO {n} hdr={hdr} img={img} hist={hist} doc={doc}"

    @staticmethod
    def _kept_sha(user_msg) -> str | None:
        try:
            for p in user_msg["content"]:
                if p.get("type") in ("image_url", "input_image"):
                    url = p["image_url"]["url"] if isinstance(p["image_url"], dict) else p["image_url"]
                    return hashlib.sha256(base64.b64decode(url.split(",", 1)[1])).hexdigest()
        except Exception:
            return None
        return None

    # -- the WebSocket upstream (Responses WebSocket mode)

    async def _ws(self, path, headers, reader, writer) -> None:
        self.stats["ws_sockets"] += 1
        key = headers.get("sec-websocket-key", "")
        fault = headers.get("x-soak-ws-fault", "none")
        if path.split("?")[0] != "/v1/responses" or not key or headers.get("sec-websocket-version") != "13" \
                or "upgrade" not in headers.get("connection", "").lower():
            self.problems.append(f"a WebSocket handshake visor should not have sent: {path} {headers}")
            await self._send(writer, b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
            return
        if fault == "refuse":
            self.stats["ws_fault:refuse"] += 1
            msg = b'{"error":{"message":"soak refused the socket","type":"invalid_request_error","code":"soak_refused"}}'
            await self._send(writer, b"HTTP/1.1 401 Unauthorized\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(msg), msg))
            return
        if fault == "head":
            self.stats["ws_fault:head"] += 1
            self._reset(writer)
            return
        await self._send(writer, ("HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
                                  f"sec-websocket-accept: {ws_accept(key)}\r\n\r\n").encode())
        for _ in range(100_000):
            try:
                msg = await asyncio.wait_for(ws_read_message(reader, writer, is_client=False), 300)
            except WsError as e:
                self.problems.append(f"visor broke the WebSocket protocol towards the upstream: {e}")
                return
            except asyncio.TimeoutError:
                return
            if msg.kind == "close":
                self.stats["ws_closed_by_visor"] += 1
                try:
                    await self._send(writer, ws_frame(8, msg.data[:2], mask=False))
                except (ConnectionError, OSError):
                    pass
                return
            if msg.kind == "binary":
                self.stats["ws_binary"] += 1
                continue
            if not await self._ws_event(msg.data, reader, writer):
                return

    async def _ws_event(self, data: bytes, reader, writer) -> bool:
        """Answers one client event; False once the socket is to end (an injected fault)."""
        raw = data.decode()
        try:
            ev = json.loads(raw)
        except ValueError:
            self.problems.append(f"visor sent an event that is not JSON: {raw[:200]!r}")
            return False
        if ev.get("type") != "response.create":
            self.stats["ws_other_event"] += 1
            await self._send(writer, ws_frame(1, data, mask=False))  # echoed as it came
            return True
        self.stats["ws_create"] += 1
        md = ev.get("metadata") if isinstance(ev.get("metadata"), dict) else {}
        fault = md.get("soak_fault", "none")
        self.stats["ws_fault:" + fault] += 1
        last_user = None
        for it in reversed(ev.get("input") or []):
            if isinstance(it, dict) and it.get("role") == "user":
                last_user = it
                break
        content = self._echo(last_user, raw, len(data), md.get("soak_nonce"), md.get("soak_img_sha"),
                             md.get("soak_img_mode"), "na", md.get("soak_doc"), md.get("soak_doc_amp") == "1")
        n = content.split(" ", 2)[1]
        rid, item = f"resp_{n}", f"msg_{n}"

        async def send(obj) -> None:
            await self._send(writer, ws_frame(1, json.dumps(obj).encode(), mask=False))

        if fault == "error":
            await send({"type": "error", "error": {"type": "server_error", "code": "soak_injected",
                                                   "message": f"soak injected error {n}"}})
            return True
        await send({"type": "response.created", "response": {"id": rid, "object": "response", "status": "in_progress",
                                                             "model": ev.get("model"), "error": None}})
        pieces = [content[i : i + 12] for i in range(0, len(content), 12)]
        pace = {"slow": 0.5, "leave": 0.3}.get(fault) or random.choice((0, 0, 0.002, 0.01))
        for i, piece in enumerate(pieces):
            if i == 1 and fault in ("cut", "stall", "closeframe"):
                if fault == "stall":
                    await asyncio.sleep(IDLE_TIMEOUT + 2)
                if fault == "closeframe":
                    await self._send(writer, ws_frame(8, ws_close_payload(1011, "soak injected close"), mask=False))
                    try:  # the close handshake: visor's reply, bounded
                        await asyncio.wait_for(ws_read_message(reader, writer, is_client=False), 3)
                    except (asyncio.TimeoutError, WsError, asyncio.IncompleteReadError, ConnectionError, OSError):
                        pass
                    return False
                self._reset(writer)
                return False
            await send({"type": "response.output_text.delta", "item_id": item, "output_index": 0,
                        "content_index": 0, "delta": piece})
            if pace:
                await asyncio.sleep(pace)
        await send({"type": "response.completed", "response": {
            "id": rid, "object": "response", "status": "completed", "model": ev.get("model"),
            "output": [{"type": "message", "id": item, "role": "assistant", "status": "completed",
                        "content": [{"type": "output_text", "text": content, "annotations": []}]}],
            "usage": {"input_tokens": len(data) // 4, "output_tokens": len(pieces),
                      "total_tokens": len(data) // 4 + len(pieces)}}})
        return True

    async def _describer(self, req, writer) -> bool:
        self.stats["describer"] += 1
        self.describer_inflight += 1
        self.describer_max_inflight = max(self.describer_max_inflight, self.describer_inflight)
        try:
            url = req["messages"][-1]["content"][1]["image_url"]["url"]
            sha = hashlib.sha256(base64.b64decode(url.split(",", 1)[1])).hexdigest()
            slow = random.random() < 0.25
            await asyncio.sleep(random.uniform(4, 6) if slow else random.uniform(1, 2.5))
            if slow:
                self.stats["describer_slow"] += 1
            out = json.dumps({"id": "d-" + nonce(), "object": "chat.completion", "model": DESCRIBER_MODEL,
                              "choices": [{"index": 0, "message": {"role": "assistant", "content": f"DESC-{sha[:16]} soak image"},
                                           "finish_reason": "stop"}]}).encode()
            await self._send(writer, b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(out), out))
            return True
        finally:
            self.describer_inflight -= 1


# ---------------------------------------------------------------- HTTP client


@dataclass
class Resp:
    status: int | None = None
    headers: dict = field(default_factory=dict)
    body: bytes = b""
    complete: bool = False
    error: str | None = None  # connection error / hang
    hang: bool = False
    elapsed: float = 0.0


class Conn:
    def __init__(self, reader, writer):
        self.reader, self.writer, self.last = reader, writer, time.monotonic()


async def _exchange(conn: Conn, port: int, method: str, path: str, headers: dict, body: bytes | None,
                    abort_after_first: bool) -> Resp:
    h = [f"{method} {path} HTTP/1.1", f"host: {HOST}:{port}"]
    for k, v in headers.items():
        h.append(f"{k}: {v}")
    if body is not None:
        h.append(f"content-length: {len(body)}")
    conn.writer.write(("\r\n".join(h) + "\r\n\r\n").encode() + (body or b""))
    await conn.writer.drain()
    r = Resp()
    try:
        head = await conn.reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as e:
        r.error = f"connection closed before the response head ({len(e.partial)} bytes)"
        return r
    lines = head.decode("latin-1").split("\r\n")
    r.status = int(lines[0].split(" ")[1])
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            r.headers[k.strip().lower()] = v.strip()
    parts = []
    try:
        if method == "HEAD" or r.status in (204, 304):
            r.complete = True
        elif r.headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                line = await conn.reader.readline()
                if not line.endswith(b"\r\n"):
                    break  # cut
                size = int(line.split(b";")[0], 16)
                if size == 0:
                    while True:
                        t = await conn.reader.readline()
                        if t == b"\r\n":
                            r.complete = True
                            break
                        if not t:
                            break
                    break
                data = await conn.reader.readexactly(size + 2)
                parts.append(data[:-2])
                if abort_after_first:
                    r.error = "client aborted"
                    break
        elif "content-length" in r.headers:
            parts.append(await conn.reader.readexactly(int(r.headers["content-length"])))
            r.complete = True
        else:
            parts.append(await conn.reader.read())
            r.complete = True
    except asyncio.IncompleteReadError as e:
        parts.append(e.partial)
    except ConnectionError:
        pass
    r.body = b"".join(parts)
    return r


class Client:
    """One keep-alive connection per instance, reused only within 2 s of its last use."""

    def __init__(self) -> None:
        self.conns: dict[int, Conn] = {}

    async def request(self, port: int, method: str, path: str, headers: dict | None = None,
                      body: bytes | None = None, abort_after_first: bool = False) -> Resp:
        headers = dict(headers or {})
        start = time.monotonic()
        conn = self.conns.pop(port, None)
        if conn is not None and (time.monotonic() - conn.last > 2.0 or conn.writer.is_closing()):
            conn.writer.close()
            conn = None
        reused = conn is not None
        try:
            if conn is None:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, port, limit=1 << 22), 5)
                conn = Conn(reader, writer)
            r = await asyncio.wait_for(_exchange(conn, port, method, path, headers, body, abort_after_first), REQUEST_BOUND)
        except asyncio.TimeoutError:
            r = Resp(error=f"no complete response in {REQUEST_BOUND:.0f} s", hang=True)
        except (ConnectionError, OSError) as e:
            r = Resp(error=f"{type(e).__name__}: {e}" + (" (reused connection)" if reused else ""))
        r.elapsed = time.monotonic() - start
        if conn is not None:
            if r.complete and r.error is None and r.headers.get("connection", "").lower() != "close":
                conn.last = time.monotonic()
                self.conns[port] = conn
            else:
                conn.writer.close()
        return r

    def close(self) -> None:
        for c in self.conns.values():
            c.writer.close()
        self.conns.clear()


def sse_content(body: bytes) -> tuple[str | None, bool]:
    """(content, ended with [DONE] as its last event) of an SSE body; content None if unreadable."""
    text = body.decode("utf-8", "replace")
    content = []
    done = False
    for event in text.split("\n\n"):
        for line in event.split("\n"):
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if done:
                return None, False  # something after [DONE]
            if data == "[DONE]":
                done = True
                continue
            try:
                obj = json.loads(data)
            except ValueError:
                return None, False
            for ch in obj.get("choices") or []:
                c = (ch.get("delta") or {}).get("content")
                if c:
                    content.append(c)
    return "".join(content), done


def json_content(body: bytes) -> str | None:
    try:
        return json.loads(body)["choices"][0]["message"]["content"]
    except Exception:
        return None


# ---------------------------------------------------------------- processes


class Redis:
    def __init__(self, out: Path) -> None:
        self.port = free_port()
        self.dir = out / "redis"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.logf = open(out / "redis.log", "ab")
        self.proc: subprocess.Popen | None = None
        self.frozen = False

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", HOST, "--save", "", "--appendonly", "no",
             "--dir", str(self.dir), "--dbfilename", "dump.rdb", "--protected-mode", "yes"],
            stdout=self.logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.command("PING") == b"+PONG\r\n":
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError("redis-server did not start (see redis.log)")

    def command(self, *args: str, timeout: float = 2.0) -> bytes | None:
        msg = b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a.encode()), a.encode()) for a in args)
        try:
            with socket.create_connection((HOST, self.port), timeout=timeout) as s:
                s.sendall(msg)
                return s.recv(4096)
        except OSError:
            return None

    def stop_saving(self) -> None:
        """SHUTDOWN SAVE: what Redis held is written to dump.rdb and read back at the next start."""
        self.command("SHUTDOWN", "SAVE", timeout=10)
        if self.proc is not None:
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
                raise RuntimeError("redis-server did not stop on SHUTDOWN SAVE")

    def freeze(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)
        self.frozen = False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            if self.frozen:
                self.thaw()
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


class Disk:
    """An 8 MB tmpfs, mounted by this script (root), with a filler file to make it full."""

    def __init__(self, path: Path, size: str) -> None:
        self.path = path
        self.size = size
        self.mounted = False
        self.filler = path / "filler"

    def mount(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size}", "tmpfs", str(self.path)],
                             capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"mount -t tmpfs failed (root needed): {out.stderr.strip()}")
        self.mounted = True

    def fill(self) -> int:
        """Writes the filler until not one byte more fits; returns the bytes written."""
        written = 0
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for size in (64 * 1024, 4096, 1):
                block = b"\0" * size
                for _ in range(1 << 13):  # bounded: 8 MB in 64 KiB blocks, then the tail
                    try:
                        n = os.write(fd, block)
                    except OSError:
                        break
                    if n <= 0:
                        break
                    written += n
            try:
                os.fsync(fd)
            except OSError:
                pass
        finally:
            os.close(fd)
        return written

    def free(self) -> None:
        try:
            self.filler.unlink()
        except FileNotFoundError:
            pass

    def usage(self) -> str:
        st = os.statvfs(self.path)
        return f"{(st.f_blocks - st.f_bfree) * st.f_frsize // 1024} KB used of {st.f_blocks * st.f_frsize // 1024} KB"

    def unmount(self) -> None:
        if self.mounted:
            r = subprocess.run(["umount", str(self.path)], capture_output=True, text=True)
            if r.returncode != 0:
                subprocess.run(["umount", "-l", str(self.path)], capture_output=True)
            self.mounted = False


@dataclass
class Window:
    start: float
    end: float | None = None  # when the store was given back; None while it is down

    def covers(self, a: float, b: float) -> bool:
        end = (self.end if self.end is not None else float("inf")) + RECOVERY_GRACE
        return a <= end and b >= self.start


class Visor:
    def __init__(self, name: str, binary: Path, out: Path, config: str) -> None:
        self.name = name
        self.binary = binary
        self.port = free_port()
        self.config_path = out / f"visor-{name}.toml"
        self.config_path.write_text(config.replace("@PORT@", str(self.port)))
        self.log_path = out / f"visor-{name}.log"
        self.proc: subprocess.Popen | None = None
        self.windows: list[Window] = []
        self.rss: list[tuple[float, int]] = []  # (t, VmRSS kB)
        self.rss_anon: list[tuple[float, int]] = []  # (t, RssAnon kB): the heap, without the mapped binary
        self.exit: dict = {}

    def check(self) -> None:
        r = subprocess.run([str(self.binary), "check", "--config", str(self.config_path)],
                           capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise RuntimeError(f"visor check failed for {self.name}:\n{r.stdout}{r.stderr}")

    def start(self) -> None:
        env = dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "info"))
        self.logf = open(self.log_path, "ab")
        self.proc = subprocess.Popen([str(self.binary), "serve", "--config", str(self.config_path)],
                                     stdout=self.logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"visor {self.name} exited {self.proc.returncode} at start; see {self.log_path}")
            try:
                with socket.create_connection((HOST, self.port), timeout=1) as s:
                    s.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
                    if s.recv(100).startswith(b"HTTP/1.1 200"):
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"visor {self.name} not healthy in 20 s; see {self.log_path}")

    def in_window(self, a: float, b: float) -> bool:
        return any(w.covers(a, b) for w in self.windows)

    def sample_rss(self, csv) -> int | None:
        try:
            fields = {}
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                k, _, v = line.partition(":")
                if k in ("VmRSS", "RssAnon", "RssFile"):
                    fields[k] = int(v.split()[0])
        except (OSError, ValueError):
            return None
        if "VmRSS" not in fields:
            return None
        t = now()
        self.rss.append((t, fields["VmRSS"]))
        self.rss_anon.append((t, fields.get("RssAnon", 0)))
        csv.write(f"{t:.1f},{self.name},{fields['VmRSS']},{fields.get('RssAnon', '')},{fields.get('RssFile', '')}\n")
        csv.flush()
        return fields["VmRSS"]

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait(5)


# ---------------------------------------------------------------- the soak


@dataclass
class Turn:
    user: str
    reply: str
    nonce: str


@dataclass
class Session:
    sid: str
    visor: Visor
    turns: list[Turn] = field(default_factory=list)  # complete 200 turns, in order
    attempts: int = 0
    prev: str | None = None
    retired: bool = False
    verified: bool = False


class Soak:
    def __init__(self, args, out: Path, mock: Mock, a: Visor, b: Visor, redis: Redis, disk: Disk) -> None:
        self.args = args
        self.out = out
        self.mock = mock
        self.a, self.b = a, b
        self.visors = [a, b]
        self.redis = redis
        self.disk = disk
        self.deadline = args.seconds
        self.table: dict[str, Counter] = defaultdict(Counter)
        self.wrong: list[dict] = []
        self.hangs = 0
        self.lost: set[tuple[str, str]] = set()
        self.duplicated: set[tuple[str, str]] = set()
        self.sessions: list[Session] = []
        self.turns_checked = 0
        self.redis_restarts = 0
        self.redis_freezes = 0
        self.disk_fills = 0
        self.recoveries: list[tuple[str, float | None]] = []
        self.crashes: list[str] = []
        self.image_pool = [make_image() for _ in range(20)]
        self.img_results: Counter = Counter()
        self.doc_results: Counter = Counter()
        self.doc_pool = [make_doc(random.choice(("pdf", "docx", "xlsx"))) for _ in range(12)]
        self.amp_pool = [make_doc("amplified") for _ in range(3)]  # few: each one's 150,000 characters are stored
        self.ws_pongs = 0
        self.ws_carried = 0
        self.ws_pings = 0
        self.wrong_file = open(out / "wrong.jsonl", "a")
        self.run_tag = nonce()[:6]

    # -- bookkeeping

    def record(self, kind: str, label: str) -> None:
        self.table[kind][label] += 1

    def bad(self, kind: str, why: str, visor: Visor, req: dict, r: Resp) -> None:
        item = {"t": round(now(), 2), "kind": kind, "why": why, "visor": visor.name, "request": req,
                "status": r.status, "complete": r.complete, "error": r.error,
                "request_id": r.headers.get("x-request-id"), "body": r.body[:600].decode("utf-8", "replace")}
        self.wrong.append(item)
        self.wrong_file.write(json.dumps(item) + "\n")
        self.wrong_file.flush()
        log(f"WRONG {kind} on {visor.name}: {why} (status {r.status}, request id {item['request_id']})")

    def label(self, r: Resp) -> str:
        if r.hang:
            return "hang"
        if r.status is None:
            return "closed-no-head" if r.error and r.error.startswith("connection closed before") else "conn-error"
        if r.error == "client aborted":
            return "aborted"
        return str(r.status) + ("" if r.complete else "-cut")

    # -- one chat request (plain, session, image)

    async def chat(self, client: Client, kind: str, visor: Visor, *, stream: bool, session: Session | None = None,
                   image: Image | None = None, image_mode: str | None = None, fault: str = "none",
                   docs: list[Doc] | None = None) -> None:
        n = nonce()
        text = f"N:{n} {kind} question {random.randint(0, 10**6)}"
        if image is not None or docs:
            content = [{"type": "text", "text": text}]
            if image is not None:
                content.append({"type": "image_url", "image_url": {"url": "data:image/png;base64," + image.b64}})
            for d in docs or []:
                content.append({"type": "file", "file": {"filename": d.filename, "file_data": d.data_url()}})
        else:
            content = text
        model = NONVISION_MODEL if (image_mode == "replace" or docs) else (VISION_MODEL if image_mode == "keep" else TEXT_MODEL)
        req = {"model": model, "messages": [{"role": "user", "content": content}]}
        if stream:
            req["stream"] = True
            req["stream_options"] = {"include_usage": True}
        headers = {"content-type": "application/json", "authorization": "Bearer soak-client-key",
                   "x-request-id": f"soak-{n}", "x-soak-nonce": n}
        if fault != "none":
            headers["x-soak-fault"] = fault
        if image is not None:
            headers["x-soak-img-sha"] = image.sha
            headers["x-soak-img-mode"] = image_mode
        if docs:
            headers["x-soak-doc"] = ",".join(d.needle for d in docs)
            if any(d.amplified for d in docs):
                headers["x-soak-doc-amp"] = "1"
        if session is not None:
            headers["x-visor-session"] = session.sid
            if session.prev:
                headers["x-soak-prev"] = session.prev
            session.attempts += 1
        desc = {"nonce": n, "model": model, "stream": stream, "fault": fault,
                "session": session.sid if session else None, "prev": session.prev if session else None,
                "image_sha": image.sha[:12] if image else None, "docs": [d.filename for d in docs or []]}
        t_start = now()
        r = await client.request(visor.port, "POST", "/v1/chat/completions", headers, json.dumps(req).encode(),
                                 abort_after_first=(fault == "slowstream"))
        t_end = now()
        self.record(kind, self.label(r))
        if r.hang:
            self.hangs += 1
            self.bad(kind, "hang", visor, desc, r)
            return
        if fault == "slowstream":  # the client left mid-stream: anything goes but a connection error before the head
            if r.status is None:
                self.bad(kind, f"connection error: {r.error}", visor, desc, r)
            return
        store_fault = session is not None and visor.in_window(t_start, t_end)
        if r.status is None:
            # A response visor had to cut before its head left (a session turn it could not store,
            # with the whole short body withheld) reaches the client as a connection closed
            # without a head: an error the client sees, allowed where a cut is allowed.
            if r.error and r.error.startswith("connection closed before") and (fault in ("mid", "stall") or store_fault):
                return
            self.bad(kind, f"connection error: {r.error}", visor, desc, r)
            return
        if r.status == 200:
            if not r.complete:
                if fault in ("mid", "stall") or store_fault:
                    return  # a cut stream: what must happen (or allowed while the store is down)
                self.bad(kind, "200 cut with no fault injected and no store down", visor, desc, r)
                return
            if stream:
                got, done = sse_content(r.body)
                if not done:
                    self.bad(kind, "200 stream complete but not ending with data: [DONE]", visor, desc, r)
                    return
            else:
                got = json_content(r.body)
            if fault != "none":
                self.bad(kind, f"200 in full although the upstream was made to fail ({fault})", visor, desc, r)
                return
            m = ECHO_RE.match(got or "")
            if not m:
                self.bad(kind, f"200 with unreadable content {got!r}", visor, desc, r)
                return
            gn, hdr, img, hist, doc = m.groups()
            if gn != n or hdr != "ok":
                self.bad(kind, f"200 answering another request: {got!r}", visor, desc, r)
                return
            allowed_img = {"replace": {"described", "placeholder"}, "keep": {"kept"}}.get(image_mode, {"none"})
            if img not in allowed_img:
                self.bad(kind, f"image not handled as it must be: img={img}", visor, desc, r)
                return
            want_doc = "na" if not docs else ("cut" if any(d.amplified for d in docs) else "read")
            if doc != want_doc:
                self.bad(kind, f"documents not handled as they must be: doc={doc} (wanted {want_doc})", visor, desc, r)
                return
            if docs:
                self.doc_results[f"{visor.name}:{doc}"] += 1
            if image is not None:
                self.img_results[f"{visor.name}:{img}"] += 1
            want_hist = "ok" if (session is not None and session.prev) else "na"
            if hist != want_hist:
                self.bad(kind, f"the previous complete turn {session.prev if session else None} was not in the history sent upstream (hist={hist})", visor, desc, r)
                return
            if session is not None:
                session.turns.append(Turn(text, got, n))
                session.prev = n
            return
        # not 200
        allowed = set()
        if fault in ("head", "mid", "stall", "slowhead", "500"):
            allowed |= {502, 504}
        if fault == "500":
            allowed.add(500)
        if store_fault:
            allowed.add(503)
        if r.status not in allowed:
            self.bad(kind, f"status {r.status} not allowed here (fault={fault}, store down={store_fault})", visor, desc, r)
            return
        if not r.complete:
            # An error answer is a session turn too (the request's messages, stored without a reply);
            # when the store cannot take it, visor withholds the answer's last bytes, as for a 200.
            if not store_fault:
                self.bad(kind, f"{r.status} answer cut with no store down", visor, desc, r)
            return
        if r.status == 503 and b"store_unavailable" not in r.body:
            self.bad(kind, "503 without store_unavailable", visor, desc, r)
        if r.status == 500 and b"soak injected 500" not in r.body:
            self.bad(kind, "500 that is not the upstream's", visor, desc, r)

    # -- the other kinds

    async def health(self, client: Client, visor: Visor) -> None:
        path = random.choice(["/healthz", "/readyz", "/metrics"])
        kind = "get" + path
        r = await client.request(visor.port, "GET", path)
        self.record(kind, self.label(r))
        desc = {"path": path}
        if r.hang:
            self.hangs += 1
            self.bad(kind, "hang", visor, desc, r)
        elif r.status != 200 or not r.complete:
            self.bad(kind, f"status {r.status} complete={r.complete}", visor, desc, r)
        elif path == "/healthz" and b'"ok"' not in r.body:
            self.bad(kind, "healthz body", visor, desc, r)
        elif path == "/readyz":
            st = json.loads(r.body).get("status")
            self.record("readyz-status", st)
            if st not in ("ready", "degraded"):
                self.bad(kind, f"readyz status {st}", visor, desc, r)
        elif path == "/metrics" and b"# TYPE visor_" not in r.body:
            self.bad(kind, "metrics without visor_ families", visor, desc, r)

    BAD_INPUTS = [
        ("invalid-json", "POST", "/v1/chat/completions", {}, b'{"model":"gpt-4o-mini","messages":[', 400, b"invalid_json"),
        ("model-null", "POST", "/v1/chat/completions", {}, b'{"model":null,"messages":[]}', 400, b"invalid_json"),
        ("not-utf8", "POST", "/v1/chat/completions", {}, b'{"model":"gpt-4o-mini","x":"\xff\xfe"}', 400, b"invalid_json"),
        ("bad-session-id", "POST", "/v1/chat/completions", {"x-visor-session": "bad id!"},
         b'{"model":"gpt-4o-mini","messages":[{"role":"user","content":"x"}]}', 400, b""),
        ("bad-vision-header", "POST", "/v1/chat/completions", {"x-visor-vision": "maybe"},
         b'{"model":"gpt-4o-mini","messages":[{"role":"user","content":"x"}]}', 400, b""),
        ("traversal", "GET", "/v1/%2e%2e/etc/passwd", {}, None, 400, b""),
        ("unknown-path", "GET", "/nope", {}, None, 404, b"unknown_url"),
        ("bad-artifact-id", "GET", "/visor/artifacts/XYZ", {}, None, 400, b""),
    ]

    async def bad_input(self, client: Client, visor: Visor) -> None:
        name, method, path, h, body, want, code = random.choice(self.BAD_INPUTS)
        headers = {"content-type": "application/json", **h}
        r = await client.request(visor.port, method, path, headers, body)
        kind = "bad-input"
        self.record(kind, self.label(r))
        desc = {"case": name}
        if r.hang:
            self.hangs += 1
            self.bad(kind, "hang", visor, desc, r)
        elif r.status != want or not r.complete or (code and code not in r.body):
            self.bad(kind, f"{name}: wanted {want} {code.decode()}", visor, desc, r)

    # -- documents (Chat Completions `file` parts) to the text-only model

    def pick_docs(self, amplified: bool) -> list[Doc]:
        first = random.choice(self.doc_pool) if random.random() < 0.5 else make_doc("pdf")
        if amplified:  # a small PDF first, then one or two amplifying spreadsheets (cut per document, per request)
            return [first] + random.sample(self.amp_pool, random.choice((1, 1, 2)))
        second = random.choice(self.doc_pool) if random.random() < 0.5 else make_doc(random.choice(("docx", "xlsx")))
        return [first, second]

    # -- the Responses WebSocket mode

    WS_EVENTS = (["ws-text"] * 40 + ["ws-image-nonvision"] * 20 + ["ws-image-vision"] * 8 + ["ws-doc"] * 12
                 + ["ws-slow"] * 8)

    async def ws_socket(self, visor: Visor) -> None:
        """One socket: a handshake, 2-6 response.create in turn (some other events and pings between),
        each answer checked; closed cleanly unless a fault closed it or the client left."""
        r = random.random()
        sock_fault = "refuse" if r < 0.03 else ("head" if r < 0.06 else "none")
        key = base64.b64encode(os.urandom(16)).decode()
        rid = f"soak-ws-{nonce()}"
        lines = ["GET /v1/responses HTTP/1.1", f"host: {HOST}:{visor.port}", "upgrade: websocket", "connection: Upgrade",
                 f"sec-websocket-key: {key}", "sec-websocket-version: 13", "authorization: Bearer soak-client-key",
                 f"x-request-id: {rid}", "openai-beta: responses_websockets=2026-02-06"]
        if sock_fault != "none":
            lines.append(f"x-soak-ws-fault: {sock_fault}")
        desc = {"socket": rid, "socket_fault": sock_fault}
        kind = "ws-handshake"
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, visor.port, limit=1 << 22), 5)
        except (OSError, asyncio.TimeoutError) as e:
            self.record(kind, "conn-error")
            self.bad(kind, f"connect: {e!r}", visor, desc, Resp(error=repr(e)))
            return
        try:
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
            await writer.drain()
            r = Resp()
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_BOUND)
                hl = head.decode("latin-1").split("\r\n")
                r.status = int(hl[0].split(" ")[1])
                for line in hl[1:]:
                    if ":" in line:
                        k, v = line.split(":", 1)
                        r.headers[k.strip().lower()] = v.strip()
                if r.status != 101 and "content-length" in r.headers:
                    r.body = await asyncio.wait_for(reader.readexactly(int(r.headers["content-length"])), REQUEST_BOUND)
                r.complete = True
            except asyncio.TimeoutError:
                r.hang, r.error = True, f"no handshake answer in {REQUEST_BOUND:.0f} s"
            except (asyncio.IncompleteReadError, ConnectionError, OSError) as e:
                r.error = f"connection closed before the response head ({e!r})"
            self.record(kind, self.label(r))
            if r.hang:
                self.hangs += 1
                self.bad(kind, "hang", visor, desc, r)
                return
            want = {"refuse": 401, "head": 502}.get(sock_fault, 101)
            if r.status != want:
                self.bad(kind, f"handshake answered {r.status} ({r.error}), wanted {want}", visor, desc, r)
                return
            if want == 401 and b"soak refused the socket" not in r.body:
                self.bad(kind, "the upstream's 401 not passed back as it came", visor, desc, r)
                return
            if want != 101:
                return
            if r.headers.get("sec-websocket-accept") != ws_accept(key):
                self.bad(kind, f"Sec-WebSocket-Accept {r.headers.get('sec-websocket-accept')!r} is not the key's", visor, desc, r)
                return
            await self._ws_events(reader, writer, visor, rid)
        finally:
            writer.close()

    async def _ws_events(self, reader, writer, visor: Visor, rid: str) -> None:
        pongs: list[bytes] = []
        pings: set[bytes] = set()
        carried = [None]  # the model the socket's last response.create named (visor carries it to one naming none)
        for i in range(random.randint(2, 6)):
            if random.random() < 0.15:  # another event, passed as it came and echoed by the mock
                e = json.dumps({"type": "soak.echo", "n": nonce()}).encode()
                writer.write(ws_frame(1, e, mask=True))
                await writer.drain()
                try:
                    m = await asyncio.wait_for(ws_read_message(reader, writer, is_client=True, pongs=pongs), REQUEST_BOUND)
                    ok = m.kind == "text" and json.loads(m.data) == json.loads(e)
                    self.record("ws-other-event", "echoed" if ok else "WRONG")
                    if not ok:
                        self.bad("ws-other-event", f"got {m.kind} {m.code} {m.data[:200]!r}", visor, {"socket": rid}, Resp(status=101))
                        return
                except (asyncio.TimeoutError, WsError, asyncio.IncompleteReadError, ConnectionError, OSError, ValueError) as ex:
                    self.record("ws-other-event", "error")
                    self.bad("ws-other-event", f"no echo: {ex!r}", visor, {"socket": rid}, Resp(status=101, error=repr(ex)))
                    return
            if random.random() < 0.2:
                pl = b"soak-" + nonce().encode()
                pings.add(pl)
                self.ws_pings += 1
                writer.write(ws_frame(9, pl, mask=True))
                await writer.drain()
            open_ = await self.ws_create(reader, writer, visor, rid, pongs, carried)
            if not open_:
                self.check_pongs(pongs, pings, visor, rid)
                return
        # a clean close: 1000 sent, 1000 back, then the connection ends
        kind = "ws-close"
        writer.write(ws_frame(8, ws_close_payload(1000, "soak done"), mask=True))
        await writer.drain()
        got = None
        try:
            for _ in range(1000):
                m = await asyncio.wait_for(ws_read_message(reader, writer, is_client=True, pongs=pongs), 10)
                if m.kind == "close":
                    got = m
                    break
            eof = await asyncio.wait_for(reader.read(1), 10)
        except (asyncio.TimeoutError, WsError, asyncio.IncompleteReadError, ConnectionError, OSError) as ex:
            self.record(kind, "no-close-reply")
            self.bad(kind, f"no close frame back after ours: {ex!r}", visor, {"socket": rid}, Resp(status=101, error=repr(ex)))
            return
        if got is None or got.code != 1000 or eof:
            self.record(kind, "wrong-close")
            self.bad(kind, f"close answered {got and got.code} then {eof!r}", visor, {"socket": rid}, Resp(status=101))
            return
        self.record(kind, "clean")
        self.check_pongs(pongs, pings, visor, rid)

    def check_pongs(self, pongs, pings, visor, rid) -> None:
        self.ws_pongs += len(pongs)
        for pl in pongs:
            if pl not in pings:
                self.bad("ws-pong", f"a pong for no ping of ours: {pl[:60]!r}", visor, {"socket": rid}, Resp(status=101))

    async def ws_create(self, reader, writer, visor: Visor, rid: str, pongs: list, carried: list) -> bool:
        """One response.create and its answer; False when the socket is over."""
        kind = random.choice(self.WS_EVENTS)
        n = nonce()
        text = f"N:{n} {kind} question {random.randint(0, 10**6)}"
        parts: list = [{"type": "input_text", "text": text}]
        md = {"soak_nonce": n}
        model = TEXT_MODEL
        image = docs = None
        if kind in ("ws-image-nonvision", "ws-image-vision"):
            image = random.choice(self.image_pool) if random.random() < 0.6 else make_image()
            parts.append({"type": "input_image", "image_url": "data:image/png;base64," + image.b64})
            md["soak_img_sha"] = image.sha
            md["soak_img_mode"] = "replace" if kind == "ws-image-nonvision" else "keep"
            model = NONVISION_MODEL if kind == "ws-image-nonvision" else VISION_MODEL
        elif kind == "ws-doc":
            docs = self.pick_docs(amplified=random.random() < 0.2)
            for d in docs:
                parts.append({"type": "input_file", "filename": d.filename, "file_data": d.data_url()})
            md["soak_doc"] = ",".join(d.needle for d in docs)
            if any(d.amplified for d in docs):
                md["soak_doc_amp"] = "1"
            model = NONVISION_MODEL
        fault = "none"
        if kind == "ws-slow":
            fault = "slow"
        elif kind != "ws-image-vision" and random.random() < 0.12:
            fault = random.choice(["error"] * 30 + ["cut"] * 30 + ["closeframe"] * 20 + ["stall"] * 10)
        elif kind == "ws-text" and random.random() < 0.06:
            fault = "leave"  # the client leaves after the first delta
        md["soak_fault"] = fault
        event = {"type": "response.create", "model": model,
                 "input": [{"type": "message", "role": "user", "content": parts}], "metadata": md}
        if carried[0] == model and model == NONVISION_MODEL and random.random() < 0.4:
            del event["model"]  # the text-only model carried from the event before: its image must still go
            model = f"(carried) {model}"
            self.ws_carried += 1
        carried[0] = event.get("model", carried[0])
        desc = {"socket": rid, "nonce": n, "model": model, "fault": fault,
                "image_sha": image.sha[:12] if image else None, "docs": [d.filename for d in docs or []]}
        writer.write(ws_frame(1, json.dumps(event).encode(), mask=True))
        await writer.drain()
        got = {"created": 0, "deltas": [], "completed": None, "error": None, "close": None, "end": None,
               "foreign": [], "other": []}
        t0 = time.monotonic()

        async def read() -> None:
            for _ in range(100_000):
                try:
                    m = await ws_read_message(reader, writer, is_client=True, pongs=pongs)
                except WsError as e:
                    got["end"] = f"protocol: {e}"
                    return
                except (asyncio.IncompleteReadError, ConnectionError, OSError) as e:
                    got["end"] = f"connection ended without a close frame ({type(e).__name__})"
                    return
                if m.kind == "close":
                    got["close"] = m.code
                    try:  # the close handshake
                        writer.write(ws_frame(8, m.data[:2], mask=True))
                        await writer.drain()
                    except (ConnectionError, OSError):
                        pass
                    return
                if m.kind == "binary":
                    got["other"].append("binary")
                    continue
                try:
                    ev = json.loads(m.data)
                except ValueError:
                    got["other"].append(m.data[:100].decode("utf-8", "replace"))
                    continue
                t = ev.get("type")
                if t == "response.created":
                    got["created"] += 1
                    if (ev.get("response") or {}).get("id") != f"resp_{n}":
                        got["foreign"].append(m.data[:200].decode())
                elif t == "response.output_text.delta":
                    if ev.get("item_id") != f"msg_{n}":
                        got["foreign"].append(m.data[:200].decode())
                    got["deltas"].append(ev.get("delta", ""))
                    if fault == "leave":
                        return
                elif t == "response.completed":
                    got["completed"] = ev
                    return
                elif t == "error":
                    got["error"] = ev
                    return
                else:
                    got["other"].append(m.data[:200].decode("utf-8", "replace"))

        try:
            await asyncio.wait_for(read(), REQUEST_BOUND)
        except asyncio.TimeoutError:
            got["end"] = "hang"
        r = Resp(status=101, elapsed=time.monotonic() - t0, error=got["end"],
                 body=json.dumps({k: v for k, v in got.items() if v}).encode())
        if got["end"] == "hang":
            self.record(kind, "hang")
            self.hangs += 1
            self.bad(kind, f"no end of the response in {REQUEST_BOUND:.0f} s", visor, desc, r)
            return False
        if got["foreign"] or got["other"]:
            self.record(kind, "foreign")
            self.bad(kind, "events not of this response", visor, desc, r)
            return False
        if got["end"] and got["end"].startswith("protocol"):
            self.record(kind, "protocol")
            self.bad(kind, got["end"], visor, desc, r)
            return False
        if fault == "leave":
            if got["end"] or got["close"] is not None or got["error"] is not None or got["completed"] is not None:
                self.record(kind, "ended-before-leaving")
                self.bad(kind, "the response ended before the client left", visor, desc, r)
                return False
            self.record(kind, "left")
            if random.random() < 0.5:
                writer.transport.abort()  # gone, no close frame
            else:
                writer.write(ws_frame(8, ws_close_payload(1001, "leaving"), mask=True))
                await writer.drain()
            return False
        if got["completed"] is not None:
            content = "".join(got["deltas"])
            try:
                final = got["completed"]["response"]["output"][0]["content"][0]["text"]
                rid_ok = got["completed"]["response"]["id"] == f"resp_{n}"
                usage = got["completed"]["response"]["usage"]
            except (KeyError, IndexError, TypeError):
                final, rid_ok, usage = None, False, None
            self.record(kind, "complete")
            if fault not in ("none", "slow"):
                self.bad(kind, f"completed in full although the upstream was made to fail ({fault})", visor, desc, r)
                return False
            if not rid_ok or final != content or got["created"] != 1 or not usage:
                self.bad(kind, f"completed, but deltas {content!r} / final {final!r} / created {got['created']}", visor, desc, r)
                return False
            mm = ECHO_RE.match(content)
            if not mm:
                self.bad(kind, f"unreadable content {content!r}", visor, desc, r)
                return False
            gn, hdr, img, hist, doc = mm.groups()
            want_img = {"ws-image-nonvision": {"described", "placeholder"}, "ws-image-vision": {"kept"}}.get(kind, {"none"})
            want_doc = "na" if not docs else ("cut" if any(d.amplified for d in docs) else "read")
            if gn != n or hdr != "ok":
                self.bad(kind, f"answering another request: {content!r}", visor, desc, r)
            elif img not in want_img:
                self.bad(kind, f"image not handled as it must be: img={img}", visor, desc, r)
            elif doc != want_doc:
                self.bad(kind, f"documents not handled as they must be: doc={doc} (wanted {want_doc})", visor, desc, r)
            else:
                if image is not None and kind == "ws-image-nonvision":
                    self.img_results[f"{visor.name}:ws:{img}"] += 1
                if docs:
                    self.doc_results[f"{visor.name}:ws:{doc}"] += 1
            return True
        if got["error"] is not None:
            self.record(kind, "error-event")
            msg = str((got["error"].get("error") or {}).get("message", ""))
            if fault == "none" or fault == "slow":
                self.bad(kind, "an error event with no fault injected", visor, desc, r)
                return False
            if fault == "error" and f"soak injected error {n}" not in msg:
                self.bad(kind, f"an error event that is not the upstream's for this request: {msg[:200]!r}", visor, desc, r)
                return False
            return True
        if got["close"] is not None:
            self.record(kind, f"close-{got['close']}")
            if fault in ("none", "slow"):
                self.bad(kind, f"socket closed ({got['close']}) with no fault injected", visor, desc, r)
            elif got["close"] != 1011:
                self.bad(kind, f"socket closed with {got['close']}, not 1011, for an injected fault", visor, desc, r)
            return False
        self.record(kind, "closed-no-frame")
        self.bad(kind, f"{got['end']}", visor, desc, r)
        return False

    # -- workers

    def pick_fault(self, stream: bool, rate: float) -> str:
        if random.random() >= rate:
            return "none"
        faults = ["head"] * 30 + ["mid"] * 35 + ["stall"] * 8 + ["slowhead"] * 4 + ["500"] * 18
        if stream:
            faults += ["slowstream"] * 5  # the client leaves mid-stream
        return random.choice(faults)

    def new_session(self, w: int, visor: Visor) -> Session:
        s = Session(f"soak-{self.run_tag}-{visor.name}-w{w}-{len(self.sessions)}", visor)
        self.sessions.append(s)
        return s

    async def worker(self, w: int) -> None:
        client = Client()
        sessions = {v.name: self.new_session(w, v) for v in self.visors}
        kinds = (["chat-json"] * 18 + ["chat-sse"] * 18 + ["session-json"] * 14 + ["session-sse"] * 14
                 + ["image-nonvision"] * 10 + ["image-vision"] * 4 + ["health"] * 14 + ["bad-input"] * 8
                 + ["doc-nonvision"] * 6 + ["doc-amplified"] * 2 + ["ws"] * 8)
        try:
            for _ in range(10_000_000):
                if now() >= self.deadline:
                    break
                kind = random.choice(kinds)
                visor = random.choice(self.visors)
                try:
                    if kind in ("chat-json", "chat-sse"):
                        stream = kind == "chat-sse"
                        await self.chat(client, kind, visor, stream=stream, fault=self.pick_fault(stream, 0.10))
                    elif kind in ("session-json", "session-sse"):
                        stream = kind == "session-sse"
                        s = sessions[visor.name]
                        if s.attempts >= TURNS_PER_SESSION:
                            s.retired = True
                            s = sessions[visor.name] = self.new_session(w, visor)
                        await self.chat(client, kind, visor, stream=stream, session=s,
                                        fault=self.pick_fault(stream, 0.10))
                    elif kind == "image-nonvision":
                        stream = random.random() < 0.5
                        r = random.random()
                        img = random.choice(self.image_pool) if r < 0.5 else make_image(big=r > 0.93)
                        await self.chat(client, kind, visor, stream=stream, image=img, image_mode="replace",
                                        fault=self.pick_fault(stream, 0.05))
                    elif kind == "image-vision":
                        await self.chat(client, kind, visor, stream=random.random() < 0.5,
                                        image=random.choice(self.image_pool), image_mode="keep")
                    elif kind in ("doc-nonvision", "doc-amplified"):
                        stream = random.random() < 0.5
                        await self.chat(client, kind, visor, stream=stream, docs=self.pick_docs(kind == "doc-amplified"),
                                        fault=self.pick_fault(stream, 0.05))
                    elif kind == "ws":
                        await self.ws_socket(visor)
                    elif kind == "health":
                        await self.health(client, visor)
                    else:
                        await self.bad_input(client, visor)
                except Exception:
                    self.crashes.append(f"worker {w} {kind}: {traceback.format_exc()}")
                    log(f"worker {w} raised: {traceback.format_exc()}")
                await asyncio.sleep(random.uniform(0.02, 0.12))
        finally:
            client.close()
            for s in sessions.values():
                s.retired = True

    # -- faults over time

    async def wait_until(self, t: float) -> None:
        while now() < t:
            await asyncio.sleep(min(0.5, max(0.01, t - now())))

    async def recovery_probe(self, visor: Visor, what: str) -> None:
        """Session requests every 0.25 s from the moment the store is back until one succeeds."""
        client = Client()
        s = Session(f"soak-{self.run_tag}-{visor.name}-probe-{len(self.sessions)}", visor)
        self.sessions.append(s)
        t0 = now()
        took = None
        for _ in range(int(RECOVERY_LIMIT * 3 / 0.25)):
            before = len(s.turns)
            await self.chat(client, "recovery-probe", visor, stream=False, session=s)
            if len(s.turns) > before:
                took = now() - t0
                break
            await asyncio.sleep(0.25)
        client.close()
        s.retired = True
        self.recoveries.append((f"{visor.name} {what}", took))
        log(f"{visor.name}: session requests succeed again {took:.2f} s after {what}" if took is not None
            else f"{visor.name}: session requests still failing {now() - t0:.0f} s after {what}")

    async def redis_faults(self) -> None:
        d = self.deadline
        n = max(1, int(d // 120))
        down = min(20.0, d / 5)
        for i in range(n):
            t = d * (i + 0.4) / n
            if t + down + RECOVERY_GRACE > d:
                break
            await self.wait_until(t)
            freeze = (i % 3 == 2)
            w = Window(now())
            self.a.windows.append(w)
            if freeze:
                log(f"redis: frozen (SIGSTOP) for {down:.0f} s")
                self.redis.freeze()
            else:
                log(f"redis: SHUTDOWN SAVE, down for {down:.0f} s")
                await asyncio.to_thread(self.redis.stop_saving)
            await asyncio.sleep(down)
            if freeze:
                self.redis.thaw()
                self.redis_freezes += 1
            else:
                await asyncio.to_thread(self.redis.start)
                self.redis_restarts += 1
            w.end = now()
            log("redis: back")
            await self.recovery_probe(self.a, "redis " + ("thawed" if freeze else "restarted"))

    async def disk_faults(self) -> None:
        d = self.deadline
        n = max(1, int(d // 90))
        hold = min(15.0, d / 6)
        for i in range(n):
            t = d * (i + 0.6) / n
            if t + hold + RECOVERY_GRACE > d:
                break
            await self.wait_until(t)
            w = Window(now())
            self.b.windows.append(w)
            written = await asyncio.to_thread(self.disk.fill)
            self.disk_fills += 1
            log(f"disk: filled ({written // 1024} KB filler; {self.disk.usage()}), held {hold:.0f} s")
            await asyncio.sleep(hold)
            self.disk.free()
            w.end = now()
            log(f"disk: freed ({self.disk.usage()})")
            await self.recovery_probe(self.b, "disk freed")

    async def sampler(self) -> None:
        csv = open(self.out / "rss.csv", "a")
        csv.write("t_seconds,visor,vmrss_kb,rssanon_kb,rssfile_kb\n")
        for _ in range(100_000):
            for v in self.visors:
                if not v.alive():
                    msg = f"visor {v.name} died (exit {v.proc.returncode}); see {v.log_path}"
                    if msg not in self.crashes:
                        self.crashes.append(msg)
                        log(msg)
                else:
                    v.sample_rss(csv)
            if now() >= self.deadline:
                break
            await asyncio.sleep(5)

    async def progress(self) -> None:
        for _ in range(100_000):
            await asyncio.sleep(30)
            if now() >= self.deadline:
                break
            total = sum(sum(c.values()) for c in self.table.values())
            rss = " ".join(f"{v.name}={v.rss[-1][1] // 1024}MB" for v in self.visors if v.rss)
            log(f"progress: {total} requests, wrong {len(self.wrong)}, lost {len(self.lost)}, hangs {self.hangs}, rss {rss}")

    # -- lost turns

    async def verify(self, client: Client, s: Session) -> bool:
        """Checks one session; False when it could not be read now (store down)."""
        if not s.turns:
            s.verified = True
            return True
        r = await client.request(s.visor.port, "GET", f"/visor/sessions/{s.sid}")
        if r.status == 503 or r.hang or r.status is None:
            return False
        msgs = []
        if r.status == 200 and r.complete:
            msgs = json.loads(r.body).get("messages", [])
        elif r.status != 404:
            self.bad("session-read", f"GET session {s.sid}: {r.status}", s.visor, {"session": s.sid}, r)
            return True
        users = [(i, m) for i, m in enumerate(msgs) if m.get("role") == "user"]
        pos = 0
        for t in s.turns:
            self.turns_checked += 1
            hits = [i for i, m in users if m.get("content") == t.user]
            if len(hits) > 1:
                self.duplicated.add((s.sid, t.nonce))
            found = None
            for i in hits:
                if i >= pos and i + 1 < len(msgs) and msgs[i + 1].get("role") == "assistant" \
                        and msgs[i + 1].get("content") == t.reply:
                    found = i
                    break
            if found is None:
                if (s.sid, t.nonce) not in self.lost:
                    self.lost.add((s.sid, t.nonce))
                    log(f"LOST turn {t.nonce} of session {s.sid} on {s.visor.name} "
                        f"({len(msgs)} messages stored, user message {'present' if hits else 'absent'})")
                    (self.out / "lost.jsonl").open("a").write(json.dumps(
                        {"t": round(now(), 2), "session": s.sid, "visor": s.visor.name, "nonce": t.nonce,
                         "user": t.user, "reply": t.reply, "stored": msgs}) + "\n")
            else:
                pos = found + 2
        s.verified = True
        return True

    async def verifier(self) -> None:
        client = Client()
        for _ in range(100_000):
            await asyncio.sleep(20)
            if now() >= self.deadline:
                break
            for s in list(self.sessions):
                if s.retired and not s.verified and not s.visor.in_window(now(), now()):
                    await self.verify(client, s)
        client.close()

    async def final_verify(self) -> None:
        client = Client()
        pending = list(self.sessions)
        self.turns_checked = 0
        for _ in range(20):
            for s in pending:
                s.verified = False
            again = []
            for s in pending:
                if not await self.verify(client, s):
                    again.append(s)
            pending = again
            if not pending:
                break
            await asyncio.sleep(2)
        for s in pending:
            self.crashes.append(f"session {s.sid} on {s.visor.name} could not be read at the end")
        client.close()

    async def run(self) -> None:
        global T0
        T0 = time.monotonic()  # the load's clock: deadline, fault windows and RSS samples count from here
        tasks = [asyncio.create_task(self.worker(w)) for w in range(self.args.workers)]
        tasks += [asyncio.create_task(x) for x in (self.redis_faults(), self.disk_faults(), self.sampler(),
                                                   self.progress(), self.verifier())]
        bound = self.deadline + 3 * REQUEST_BOUND + 60
        done, pending = await asyncio.wait(tasks, timeout=bound)
        for t in pending:
            t.cancel()
            self.crashes.append(f"task not finished {bound:.0f} s after the start: {t.get_coro().__name__}")
        for t in done:
            if t.exception():
                self.crashes.append(f"task failed: {t.exception()!r}")
        # a clean end state: Redis up, disk free, then every session read back
        if self.redis.frozen:
            self.redis.thaw()
        if self.redis.proc.poll() is not None:
            self.redis.start()
        self.disk.free()
        await asyncio.sleep(2)
        log("verifying every session")
        await self.final_verify()


# ---------------------------------------------------------------- summary


def rss_summary(v: Visor, duration: float) -> tuple[str, bool]:
    window = min(60.0, duration / 3)
    first = [kb for t, kb in v.rss if t <= window]
    last = [kb for t, kb in v.rss if t >= duration - window]
    if not first or not last:
        return f"{v.name}: too few RSS samples ({len(v.rss)})", False
    fm, lm = statistics.median(first), statistics.median(last)
    mx = max(kb for _, kb in v.rss)
    allowed = max(0.20 * fm, 20 * 1024)
    flat = lm - fm <= allowed
    per_minute = []
    for m in range(int(duration // 60) + 1):
        xs = [kb for t, kb in v.rss if m * 60 <= t < (m + 1) * 60]
        if xs:
            per_minute.append(f"{statistics.median(xs) / 1024:.1f}")
    anon_first = [kb for t, kb in v.rss_anon if t <= window]
    anon_last = [kb for t, kb in v.rss_anon if t >= duration - window]
    anon = (f"; RssAnon (heap) first median {statistics.median(anon_first) / 1024:.1f} MB, last median "
            f"{statistics.median(anon_last) / 1024:.1f} MB" if anon_first and anon_last else "")
    return (f"visor {v.name}: {len(v.rss)} samples; first {window:.0f} s median {fm / 1024:.1f} MB, last {window:.0f} s "
            f"median {lm / 1024:.1f} MB ({(lm - fm) / 1024:+.1f} MB), max {mx / 1024:.1f} MB -> "
            f"{'flat' if flat else 'NOT FLAT'}{anon}\n    VmRSS median per minute (MB): {' '.join(per_minute)}"), flat


def metric_lines(text: str, names: tuple[str, ...]) -> list[str]:
    return [l for l in text.splitlines() if l.startswith(names) and not l.endswith(" 0")]


async def shutdown(v: Visor) -> None:
    """SIGTERM: /readyz must say 503 during the drain delay, and visor must exit 0 in time."""
    t0 = time.monotonic()
    v.proc.send_signal(signal.SIGTERM)
    client = Client()
    ready = None
    for _ in range(10):
        r = await client.request(v.port, "GET", "/readyz", {"connection": "close"})
        ready = r.status
        if ready == 503:
            break
        await asyncio.sleep(0.1)
    client.close()
    bound = DRAIN_DELAY + DRAIN_TIMEOUT + 5
    code = None
    for _ in range(int(bound * 20)):
        code = v.proc.poll()
        if code is not None:
            break
        await asyncio.sleep(0.05)
    took = time.monotonic() - t0
    if code is None:
        v.proc.kill()
        v.proc.wait(5)
    v.exit = {"code": code, "seconds": round(took, 2), "readyz_after_sigterm": ready}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=600, help="load duration, at least 60 (default 600)")
    ap.add_argument("--workers", type=int, default=8, help="concurrent client workers (default 8)")
    ap.add_argument("--binary", default=str(REPO / "target/release/visor"))
    ap.add_argument("--no-build", action="store_true", help="do not run cargo build --release first")
    ap.add_argument("--out", help="output folder (default target/soak/<timestamp>)")
    ap.add_argument("--seed", type=int, help="random seed (default: from the clock)")
    args = ap.parse_args()
    if args.seconds < 60:
        ap.error("--seconds must be at least 60 (one Redis restart and one disk fill)")
    seed = args.seed if args.seed is not None else int(time.time())
    random.seed(seed)
    out = Path(args.out) if args.out else REPO / "target/soak" / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        print("soak: needs root (it mounts a tmpfs)", file=sys.stderr)
        return 2
    if shutil.which("redis-server") is None:
        print("soak: redis-server not found (apt-get install redis-server)", file=sys.stderr)
        return 2
    if not args.no_build:
        log("cargo build --release")
        r = subprocess.run(["cargo", "build", "--release", "--bin", "visor"], cwd=REPO)
        if r.returncode != 0:
            print("soak: cargo build --release failed", file=sys.stderr)
            return 2
    binary = Path(args.binary)
    log(f"output in {out} (seed {seed}); binary {binary} built {time.ctime(binary.stat().st_mtime)}")

    mock = Mock()
    redis = Redis(out)
    disk = Disk(out / "tmpfs", "8m")
    visors: list[Visor] = []
    soak = None
    try:
        mock.start()
        redis.start()
        disk.mount()
        common = f"""
[server]
listen = "{HOST}:@PORT@"
workers = 2
request_timeout_secs = 60
first_byte_timeout_secs = {FIRST_BYTE_TIMEOUT}
idle_timeout_secs = {IDLE_TIMEOUT}
drain_delay_secs = {DRAIN_DELAY}
drain_timeout_secs = {DRAIN_TIMEOUT}
header_timeout_secs = 10
max_body_bytes = {MAX_BODY_BYTES}
data_dir = "@DATA@"

[[upstream]]
name = "mock"
base_url = "http://{HOST}:{mock.port}/v1"
models = ["*"]

[describer]
upstream = "mock"
model = "{DESCRIBER_MODEL}"
timeout_secs = {DESCRIBER_TIMEOUT}
concurrency = 4
on_miss = "@ONMISS@"

[sessions]
max_depth = 400
"""
        a_cfg = (common.replace("@DATA@", str(out / "A-data")).replace("@ONMISS@", "wait")
                 + f'\n[store]\nbackend = "redis://{HOST}:{redis.port}/0"\nprefix = "soak:"\n')
        b_cfg = (common.replace("@DATA@", str(disk.path)).replace("@ONMISS@", "placeholder")
                 + f'\n[images]\nartifacts_dir = "{out / "B-artifacts"}"\n\n[store]\nbackend = "disk"\n')
        a = Visor("A", binary, out, a_cfg)
        b = Visor("B", binary, out, b_cfg)
        visors = [a, b]
        for v in visors:
            v.check()
            v.start()
            log(f"visor {v.name} on {HOST}:{v.port} (pid {v.proc.pid}), config {v.config_path}, log {v.log_path}")
        log(f"mock upstream on {HOST}:{mock.port}, redis on {HOST}:{redis.port}, tmpfs {disk.path} ({disk.usage()})")
        soak = Soak(args, out, mock, a, b, redis, disk)
        asyncio.run(soak.run())
        duration = now()
        metrics = {}
        for v in visors:
            if v.alive():
                try:
                    with socket.create_connection((HOST, v.port), timeout=5) as s:
                        s.sendall(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
                        data = b""
                        for _ in range(10_000):
                            chunk = s.recv(65536)
                            if not chunk:
                                break
                            data += chunk
                    metrics[v.name] = data.decode("utf-8", "replace")
                    (out / f"metrics-{v.name}.txt").write_text(metrics[v.name])
                except OSError as e:
                    metrics[v.name] = f"unreadable: {e}"
        for v in visors:
            if v.alive():
                asyncio.run(shutdown(v))
            else:
                v.exit = {"code": v.proc.returncode, "seconds": None, "readyz_after_sigterm": None, "died": True}
        return summary(soak, args, out, duration, metrics)
    except KeyboardInterrupt:
        print("soak: interrupted", file=sys.stderr)
        return 130
    finally:
        for v in visors:
            v.kill()
        redis.kill()
        disk.unmount()
        mock.stop()


def summary(soak: Soak, args, out: Path, duration: float, metrics: dict) -> int:
    lines = []
    p = lines.append
    p("")
    p(f"== visor soak: {args.seconds:.0f} s of load, {duration:.0f} s in all, {args.workers} workers, output {out}")
    labels = sorted({l for c in soak.table.values() for l in c}, key=lambda s: (not s[:3].isdigit(), s))
    labels = [l for l in labels if l not in ("ready", "degraded")]
    kinds = [k for k in soak.table if k != "readyz-status"]
    w = max(len(k) for k in kinds + ["kind"]) + 2
    cw = [max(7, len(l)) + 2 for l in labels]
    p("requests by kind and outcome (status; -cut: body or stream cut; closed-no-head: connection closed before a head)")
    p("kind".ljust(w) + "".join(l.rjust(c) for l, c in zip(labels, cw)) + "total".rjust(9))
    for k in sorted(kinds):
        c = soak.table[k]
        p(k.ljust(w) + "".join(str(c.get(l, "")).rjust(x) for l, x in zip(labels, cw)) + str(sum(c.values())).rjust(9))
    tot = Counter()
    for k in kinds:
        tot.update(soak.table[k])
    p("all".ljust(w) + "".join(str(tot.get(l, "")).rjust(x) for l, x in zip(labels, cw)) + str(sum(tot.values())).rjust(9))
    rs = soak.table.get("readyz-status", Counter())
    p(f"readyz: {dict(rs)}; images to {NONVISION_MODEL}: {dict(sorted(soak.img_results.items()))}")
    p(f"documents to {NONVISION_MODEL} (read: each one's line reached the model, no document bytes; cut: the amplifying "
      f"spreadsheet cut, the body within {MAX_BODY_BYTES} bytes): {dict(sorted(soak.doc_results.items()))}; "
      f"largest upstream body with documents {soak.mock.stats.get('upstream_body_max_with_documents', 0)} bytes")
    p(f"websocket: pings sent {soak.ws_pings}, pongs back {soak.ws_pongs}; response.create naming no model "
      f"(the text-only model carried from the one before): {soak.ws_carried}")
    p(f"mock upstream: {dict(sorted(soak.mock.stats.items()))}, describer calls open at the mock at most {soak.mock.describer_max_inflight} (both visors, calls visor gave up on included)")
    complete_turns = sum(len(s.turns) for s in soak.sessions)
    p(f"sessions: {len(soak.sessions)}, turns answered 200 in full: {complete_turns}, checked at the end: {soak.turns_checked}")
    p(f"redis restarts (SHUTDOWN SAVE, ~20 s down): {soak.redis_restarts}; redis freezes (SIGSTOP): {soak.redis_freezes}; "
      f"disk fills: {soak.disk_fills}")
    slow = False
    for what, took in soak.recoveries:
        ok = took is not None and took <= RECOVERY_LIMIT
        slow |= not ok
        p(f"  recovery after {what}: {'%.2f s' % took if took is not None else 'NEVER'}{'' if ok else '  <-- over ' + str(RECOVERY_LIMIT) + ' s'}")
    flat_all = True
    for v in soak.visors:
        text, flat = rss_summary(v, soak.deadline)
        flat_all &= flat
        p("RSS " + text)
    p("RSS rule: flat when last-window median - first-window median <= max(20 % of the first, 20 MB); window = min(60 s, duration/3)")
    clean = True
    for v in soak.visors:
        e = v.exit
        ok = e.get("code") == 0 and e.get("readyz_after_sigterm") == 503
        clean &= ok
        p(f"shutdown {v.name}: exit {e.get('code')} in {e.get('seconds')} s (bound {DRAIN_DELAY + DRAIN_TIMEOUT + 5} s), "
          f"/readyz after SIGTERM {e.get('readyz_after_sigterm')}{'' if ok else '  <-- NOT CLEAN'}")
    for name, text in metrics.items():
        for l in metric_lines(text, ("visor_session_turns_total", "visor_describe_total", "visor_store_errors_total",
                                     "visor_upstream_errors_total", "visor_artifact_write_errors_total")):
            p(f"  metrics {name}: {l}")
    panics = []
    for v in soak.visors:
        logtext = v.log_path.read_text(errors="replace")
        for l in logtext.splitlines():
            if "panicked" in l or "PANIC" in l:
                panics.append(f"{v.name}: {l}")
        counts = [logtext.count(x) for x in ("store unavailable: going on", "store is back",
                                             'outcome="session_not_stored"', 'refused error="store_unavailable"')]
        p(f"log {v.name}: 'store unavailable' {counts[0]}, 'store is back' {counts[1]}, "
          f"outcome session_not_stored {counts[2]}, refused store_unavailable {counts[3]}")
    if soak.mock.problems:
        soak.crashes += ["mock: " + x for x in soak.mock.problems]
    p(f"wrong answers: {len(soak.wrong)}   lost turns: {len(soak.lost)}   duplicated turns: {len(soak.duplicated)}   "
      f"hangs: {soak.hangs}   panics in logs: {len(panics)}   other failures: {len(soak.crashes)}")
    for x in soak.wrong[:10]:
        p(f"  wrong: {json.dumps(x)[:400]}")
    for x in panics[:5] + soak.crashes[:5]:
        p(f"  failure: {x[:600]}")
    passed = not (soak.wrong or soak.lost or soak.duplicated or soak.hangs or panics or soak.crashes) \
        and flat_all and clean and not slow
    p(f"RESULT: {'PASS' if passed else 'FAIL'}")
    text = "\n".join(lines)
    print(text)
    (out / "summary.txt").write_text(text + "\n")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
