"""Loading the engine of :class:`~localmoe.tui.app.ChatApp` in a worker thread, with progress.

The engine comes from the app's ``engine_factory`` (by default ``localmoe.LLM``); a chat whose
settings need another engine (model, backend, KV format, context) reloads it, never under a
running answer.
"""

from __future__ import annotations

from pathlib import Path

from textual import work

from localmoe.errors import LocalMoEError
from localmoe.io.store import DEFAULT_MODEL

from .engine_api import EngineProtocol, expert_stats, sampling_defaults
from .store import ChatSettings

NO_MODEL_HELP = (
    "Pick a model with `localmoe chat -m MODEL` (a .gguf file, an HF model folder "
    "or a name from `localmoe models`); `localmoe pull smollm2` fetches a small one to try."
)


class EngineLoading:
    """Mixin of :class:`~localmoe.tui.app.ChatApp`: (re)load the engine the current chat needs
    in a worker and show its progress, failure or stats."""

    def _key_for(self, settings: ChatSettings) -> tuple:
        return (self.model, settings.backend or self.default_backend,
                settings.kv_cache or self.default_kv, self.n_ctx_arg)

    def _ensure_engine(self) -> None:
        """Load (or reload) the engine when the current chat needs a different one."""
        key = self._key_for(self.settings)
        if key == self.engine_key and (self.engine is not None or self.loading):
            return
        if self.generating:  # never close the engine under a running answer
            self._reload_pending = True
            return
        self._reload_pending = False
        self._wanted_key = key
        old, self.engine = self.engine, None
        self.engine_key = key
        self.loading = True
        self.load_error = None
        self._progress(0.0)
        name = Path(str(self.model)).name if self.model else "the default model"
        self._stats(status=f"loading {name}…")
        self._update_titles()
        self._load_worker(key, old)

    @work(thread=True, exclusive=True, group="load")
    def _load_worker(self, key: tuple, old: EngineProtocol | None) -> None:
        model, backend, kv, n_ctx = key
        if old is not None:
            try:
                old.close()
            except Exception:
                pass

        def progress(fraction: float, message: str = "") -> None:
            self._ui(self._on_load_progress, key, fraction, message)

        try:
            extra = {"device": self.device} if self.device is not None else {}
            engine = self.engine_factory(model, backend=backend, n_ctx=n_ctx, kv_cache=kv,
                                         progress=progress, **extra)
        except LocalMoEError as e:
            hint = f" {NO_MODEL_HELP}" if model is None else ""
            self._ui(self._on_load_failed, key,
                     f"Could not load the model {model or '(default)'}: {e}{hint}")
        except Exception as e:  # a bug, but the UI must not die
            self._ui(self._on_load_failed, key,
                     f"Could not load the model {model}: unexpected {type(e).__name__}: {e}")
        else:
            self._ui(self._on_loaded, key, engine)

    def _on_load_progress(self, key: tuple, fraction: float, message: str) -> None:
        if key != self._wanted_key:
            return
        self._progress(fraction)
        self._stats(status=f"loading {fraction * 100:.0f}% {message}".rstrip())

    def _on_load_failed(self, key: tuple, message: str) -> None:
        if key != self._wanted_key:
            return
        self.loading = False
        self.load_error = message
        self._progress(None)
        self._stats(status="model not loaded")
        self._update_titles()
        self._show_error(message)

    def _on_loaded(self, key: tuple, engine: EngineProtocol) -> None:
        if key != self._wanted_key:
            engine.close()
            return
        self.engine = engine
        self.loading = False
        self.load_error = None
        self._progress(None)
        try:
            self.model_defaults = sampling_defaults(getattr(engine.model_file, "metadata", None))
        except Exception:
            self.model_defaults = {}
        self._saved(self.store.set_meta, "last_model",
                    str(self.model) if self.model is not None else DEFAULT_MODEL)
        rs = self._runner_stats()
        hit, gbps = expert_stats(rs)
        self._stats(status="", backend=getattr(engine, "backend_name", None),
                    device=rs.get("device"), n_ctx=getattr(engine, "n_ctx", None),
                    kv_bytes=rs.get("kv_bytes"), expert_hit_rate=hit, h2d_gbps=gbps)
        self._update_titles()

    def _runner_stats(self) -> dict:
        try:
            runner = getattr(self.engine, "runner", None)
            s = runner.stats() if runner is not None else {}
            return s if isinstance(s, dict) else {}
        except Exception:
            return {}
