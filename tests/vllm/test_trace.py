"""The trace-context middleware and its installation into a stand-in of vLLM's app builder."""

from __future__ import annotations

import asyncio
import sys
import types
from argparse import Namespace
from typing import Any

import pytest

from sidecar_client.vllm._trace import TraceContextMiddleware, current_trace, install_into_vllm, trace_metadata

TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def run(scope: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    seen: list[tuple[tuple[str, str], ...]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        async def child() -> None:  # vLLM's tokenize hook runs in a task gathered from the request's
            seen.append(current_trace())

        await asyncio.gather(child())

    async def main() -> None:
        await TraceContextMiddleware(app)(scope, None, None)  # type: ignore[arg-type]
        assert current_trace() == ()  # reset after the request

    asyncio.run(main())
    return seen[0]


def test_http_request_headers_reach_the_tokenize_task() -> None:
    headers = [(b"content-type", b"application/json"), (b"traceparent", TP.encode()), (b"tracestate", b"k=v")]
    assert run({"type": "http", "headers": headers}) == (("traceparent", TP), ("tracestate", "k=v"))


def test_no_headers_or_not_http() -> None:
    assert run({"type": "http", "headers": [(b"x", b"y")]}) == ()
    assert run({"type": "lifespan"}) == ()


def test_trace_metadata_from_vllm_trace_headers() -> None:
    assert trace_metadata(None) == ()
    assert trace_metadata({"traceparent": TP, "x-other": "1"}) == (("traceparent", TP),)


class App:
    def __init__(self) -> None:
        self.middleware: list[type] = []

    def add_middleware(self, cls: type) -> None:
        self.middleware.append(cls)


@pytest.fixture
def fake_app_module(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    mod = types.ModuleType("vllm.entrypoints.launchers.app")
    calls: list[Any] = []

    def init_entrypoints_middleware(args: Any, app: Any, supported_tasks: Any) -> None:
        calls.append(supported_tasks)

    mod.init_entrypoints_middleware = init_entrypoints_middleware  # type: ignore[attr-defined]
    mod.calls = calls  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.entrypoints.launchers.app", mod)
    return mod


def test_install_wraps_vllms_middleware_setup_once(fake_app_module: types.ModuleType) -> None:
    assert install_into_vllm() and install_into_vllm()
    app = App()
    fake_app_module.init_entrypoints_middleware(Namespace(middleware=[]), app, ("generate",))
    assert app.middleware == [TraceContextMiddleware]
    assert fake_app_module.calls == [("generate",)]  # vLLM's own setup still runs


def test_install_respects_an_explicit_middleware_flag(fake_app_module: types.ModuleType) -> None:
    install_into_vllm()
    app = App()
    args = Namespace(middleware=["sidecar_client.vllm.TraceContextMiddleware"])
    fake_app_module.init_entrypoints_middleware(args, app, ("generate",))
    assert app.middleware == []  # vLLM adds it from --middleware itself


def test_install_without_vllms_app_module(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "vllm.entrypoints.launchers.app", raising=False)
    assert install_into_vllm() is False
