"""``AdminClient``: the admin REST API of a PS shard over httpx (errors → Persimmon errors;
answers → the typed records of :mod:`services.common.admin_replies`)."""

from __future__ import annotations

from typing import Any, TypeVar

import httpx
import msgspec

from services.common import admin_replies as replies
from services.common.auth import ClientSecurity
from services.common.errors import MalformedMessage, error_from_http
from services.common.messages import OptimizerInfo, TableCounters
from services.common.tls import ClientTLS

__all__ = ["AdminClient"]

T = TypeVar("T")


class AdminClient:
    """Async client of one service's admin API, e.g. ``AdminClient("http://127.0.0.1:8081")``.

    ``token``/``tls`` default to ``PERSIMMON_TOKEN``(``_FILE``) and ``PERSIMMON_TLS_CA``….
    """

    def __init__(self, base_url: str, *, timeout: float = 30.0,
                 transport: httpx.AsyncBaseTransport | None = None, token: str | None = None,
                 tls: ClientTLS | None = None) -> None:
        security = ClientSecurity.resolve(token=token, tls=tls)
        self._http = httpx.AsyncClient(
            base_url=base_url, timeout=timeout, transport=transport, headers=security.headers(),
            verify=security.tls.ssl_context() if security.tls else True)

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AdminClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def request(self, method: str, path: str, json: Any = None) -> Any:
        """The JSON answer to ``method path`` (None when empty); an error answer raised as its
        Persimmon error."""
        response = await self._http.request(method, path, json=json)
        if response.status_code >= 400:
            try:
                body = response.json()
            except ValueError:
                body = {"message": response.text}
            raise error_from_http(response.status_code, body)
        return response.json() if response.content else None

    async def _typed(self, kind: type[T], method: str, path: str, json: Any = None) -> T:
        """The answer to ``method path`` as a ``kind`` (MalformedMessage naming the field
        that does not fit)."""
        answer = await self.request(method, path, json)
        try:
            return msgspec.convert(answer, kind)
        except msgspec.ValidationError as exc:
            raise MalformedMessage(f"{method} {path} answered what is not a "
                                   f"{getattr(kind, '__name__', kind)}: {exc}") from exc

    async def healthy(self) -> bool:
        return (await self._http.get("/healthz")).status_code == 200

    async def ready(self) -> bool:
        return (await self._http.get("/readyz")).status_code == 200

    async def config(self) -> dict[str, Any]:
        """The service's effective config (each service has its own keys)."""
        return await self.request("GET", "/v1/config")

    async def tables(self) -> list[replies.TableSummary]:
        return await self._typed(list[replies.TableSummary], "GET", "/v1/tables")

    async def create_table(self, config: dict[str, Any]) -> replies.TableSummary:
        """Create a table from its config (``name``, ``dim``, ``optimizer``, ...)."""
        return await self._typed(replies.TableSummary, "POST", "/v1/tables", config)

    async def table(self, name: str) -> replies.TableDescription:
        return await self._typed(replies.TableDescription, "GET", f"/v1/tables/{name}")

    async def delete_table(self, name: str) -> None:
        await self.request("DELETE", f"/v1/tables/{name}")

    async def table_stats(self, name: str) -> TableCounters:
        return await self._typed(TableCounters, "GET", f"/v1/tables/{name}/stats")

    async def row(self, name: str, row_id: int) -> replies.Row:
        return await self._typed(replies.Row, "GET", f"/v1/tables/{name}/rows/{row_id}")

    async def set_optimizer(self, name: str, **changes: Any) -> OptimizerInfo:
        """Change optimizer hyper-parameters (e.g. ``lr=0.02``); returns the optimizer now."""
        return await self._typed(OptimizerInfo, "PATCH", f"/v1/tables/{name}/optimizer",
                                 changes)

    async def checkpoint(self, checkpoint_id: str | None = None, *,
                         incremental: bool = False, epoch: int | None = None
                         ) -> replies.CheckpointManifest:
        body: dict[str, Any] = {"incremental": incremental}
        if checkpoint_id is not None:
            body["id"] = checkpoint_id
        if epoch is not None:
            body["epoch"] = epoch
        return await self._typed(replies.CheckpointManifest, "POST", "/v1/checkpoints", body)

    async def checkpoints(self) -> list[replies.CheckpointSummary]:
        return await self._typed(list[replies.CheckpointSummary], "GET", "/v1/checkpoints")

    async def restore(self, checkpoint_id: str) -> replies.Restored:
        return await self._typed(replies.Restored, "POST",
                                 f"/v1/checkpoints/{checkpoint_id}/restore")

    async def metrics(self) -> str:
        response = await self._http.get("/metrics")
        response.raise_for_status()
        return response.text
