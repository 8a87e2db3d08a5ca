"""VllmRefit: the trainer-side driver for an offline `vllm.LLM` or a `vllm serve` endpoint (`HttpEngine`).
Imports nothing of vLLM, so a trainer host that talks to vLLM over HTTP needs none."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict
from typing import Any

from refit.checks.canary import Canary
from refit.errors import HandshakeError, RefitError
from refit.integrations.vllm.cache import CachePolicy, VersionSalt, check_cache_policy, salted
from refit.integrations.vllm.canary import VllmCanary
from refit.integrations.vllm.draft import DRAFT_PREFIX
from refit.integrations.vllm.engine import VllmOptions
from refit.log import get_logger

log = get_logger("vllm")


class HttpEngine:
    """A `vllm serve` endpoint seen through its weight-transfer HTTP routes (VLLM_SERVER_DEV_MODE=1).

    Has the same methods as an offline `vllm.LLM`, so `VllmRefit` drives either. Standard library only.
    """

    def __init__(self, base_url: str, *, timeout_s: float = 600.0) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http:// or https:// URL of a vllm serve endpoint, not {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s

    def _post(self, route: str, body: dict | None = None) -> dict:
        import urllib.error
        import urllib.request

        req = urllib.request.Request(  # noqa: S310 - the scheme is checked in __init__
            f"{self.base_url}/{route}",
            data=json.dumps(body or {}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:  # noqa: S310 - scheme checked in __init__
                raw = resp.read()
        except urllib.error.HTTPError as e:
            raise RefitError(
                f"vLLM server answered {e.code} on /{route}: {e.read().decode(errors='replace')[:2000]}"
            ) from None
        except urllib.error.URLError as e:
            raise RefitError(f"cannot reach the vLLM server at {self.base_url}: {e.reason}") from None
        try:
            out = json.loads(raw) if raw else {}
        except ValueError:
            return {}
        return out if isinstance(out, dict) else {}

    def init_weight_transfer_engine(self, request: dict) -> None:
        self._post("init_weight_transfer_engine", request)

    def start_weight_update(self) -> None:
        self._post("start_weight_update")

    def start_draft_weight_update(self) -> None:
        self._post("start_draft_weight_update")

    def update_weights(self, request: dict) -> None:
        self._post("update_weights", request)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._post("finish_weight_update", {"weight_version": weight_version} if weight_version else None)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        flag = "true" if reset_running_requests else "false"
        return bool(self._post(f"reset_prefix_cache?reset_running_requests={flag}").get("success", True))

    def pause_generation(self, *, mode: str = "abort") -> None:
        """vLLM's /pause (AsyncLLM.pause_generation); caches are left to `reset_prefix_cache`."""
        self._post(f"pause?mode={mode}&clear_cache=false")

    def resume_generation(self) -> None:
        self._post("resume")

    def collective_rpc(self, method: str) -> list:
        """vLLM's /collective_rpc (dev mode): `method` run by every worker, one result each (no arguments)."""
        results = self._post("collective_rpc", {"method": method}).get("results")
        return results if isinstance(results, list) else []


class VllmRefit:
    """Refits an offline `vllm.LLM` made with `weight_transfer_config={"backend": "refit"}`, or a
    `vllm serve` endpoint (pass an `HttpEngine`).

    The workers' receive runs through vLLM's own calls (which block) while the Sender pushes from one
    background thread, joined before any call returns, so no two threads ever drive the Sender. A
    refused manifest raises the Sender's `HandshakeError` (vLLM keeps serving its last weights); any
    other failure raises `RefitError` carrying both the worker's and the trainer's messages. A failure
    of the trainer's own code (its source raised) closes the Sender, so the workers stop waiting for
    buckets at once: make a new Sender and driver to retry.
    """

    def __init__(
        self,
        llm: Any,
        sender: Any,
        *,
        options: VllmOptions | None = None,
        staged: bool = False,
        cache_policy: CachePolicy = "reset",
        canary: Canary | None = None,
    ) -> None:
        """`staged`: the workers receive each refit into staging memory on a background thread while vLLM
        keeps generating with its current version; generation pauses (vLLM's `pause_generation(mode="keep")`,
        in-flight requests kept) only for the final copy, the version and the prefix-cache reset.

        `cache_policy`: what vLLM's prefix cache does at each commit (refit.integrations.vllm.cache):
        'reset' (the default) drops every KV block; 'salt' drops none but starts a new `cache_salt`
        (`self.cache_salt`), which `generate()` puts on every prompt and other clients must send with each
        request; 'keep' leaves KV of older versions to be hit (stale: for measuring only).

        `canary` (refit.checks.canary.Canary): at the first refit and every `canary.every`-th after it, vLLM
        scores the probe after the commit's post-processing (what it computes with, repacked tensors included)
        and the driver compares it with the trainer's scores; a token beyond the tolerance fails the refit,
        named, and `generate` is refused until a refit passes. Give it here, not to the Sender."""
        self.llm = llm
        self.sender = sender
        self.staged = staged
        self.options = options or VllmOptions()
        self.cache_policy = check_cache_policy(cache_policy)
        self._salt = VersionSalt()
        if cache_policy == "keep":
            log.warning(
                "cache_policy 'keep': vLLM's prefix cache keeps KV computed with older versions after each "
                "refit, so a cached prompt is served partly with old weights (stale)"
            )
        if canary is not None and isinstance(llm, HttpEngine):
            raise ValueError("a canary needs an offline vllm.LLM (it reads prompt log-probabilities), not HttpEngine")
        self._canary = VllmCanary(canary) if canary is not None else None
        self._connected = False
        self._thread: threading.Thread | None = None
        self._rpc_warned = False
        config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
        # a Sender's count is its option; a per-rank or M:N session counts its workers itself
        expected = getattr(sender, "num_receivers", None) or sender.options.num_receivers
        workers = config.parallel_config.world_size if config is not None else expected
        if workers != expected:
            raise ValueError(
                f"this vLLM has {workers} workers (TP x PP), each a receiver: make the Sender with "
                f"num_receivers={workers}, not {expected}"
            )
        self.failure = ""
        """Why the last refit failed partway (vLLM then holds mixed weights); empty when current."""

    def _concurrently(self, trainer_side: Any, engine_side: Any, on_engine_error: Any = None) -> Any:
        if self._thread is not None and self._thread.is_alive():
            raise RefitError(
                "the Sender's thread from an earlier call is still running; this driver starts no "
                "second one on the same Sender (close it and make a new Sender)"
            )
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                result["value"] = trainer_side()
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                result["error"] = e
                if not isinstance(e, RefitError):
                    # The trainer's own failure (its source raised, say) leaves the workers waiting for the
                    # next bucket until their timeout; closing the Sender ends their wait now.
                    self.sender.close()

        self._thread = threading.Thread(target=run, name="refit-sender", daemon=True)
        self._thread.start()
        engine_error: Exception | None = None
        try:
            engine_side()
        except Exception as e:  # noqa: BLE001 - any failure of vLLM's side is reported together with the trainer's
            engine_error = e
            if on_engine_error is not None:
                on_engine_error()
        # Every wait inside the Sender is bounded by its timeout, so this join ends; the bound is a backstop.
        self._thread.join(4 * self.sender.settings.timeout_s + 60)
        if self._thread.is_alive():
            raise RefitError(
                f"the Sender's thread did not finish within {4 * self.sender.settings.timeout_s + 60:.0f} s "
                f"(worker: {engine_error}); this driver refuses further refits on that Sender"
            )
        return _outcome(result, engine_error)

    def connect(self) -> None:
        """Set up vLLM's side and the Sender's session together. When vLLM's side fails, its error is
        raised at once and the Sender is closed: assign a new Sender (`driver.sender = ...`) to retry."""
        if self._connected:
            return
        info = {
            "rendezvous": self.sender.rendezvous(),
            "timeout_s": self.sender.settings.timeout_s,
            "staged": self.staged,
            "options": {
                **asdict(self.options),
                "fallback": list(self.options.fallback),
                "ignore": list(self.options.ignore),
            },
        }
        # vLLM failing to set up its side means no receiver will ever connect: closing the Sender ends
        # its wait for them now (not after the connect timeout), and the driver can take a new Sender.
        self._concurrently(
            self.sender.connect,
            lambda: self.llm.init_weight_transfer_engine({"init_info": info}),
            on_engine_error=self.sender.close,
        )
        self._connected = True

    def refit(self, version: int) -> Any:
        """Push the source's weights as `version`, then drop KV computed with the old weights.

        The returned stats are the Sender's, plus the workers' own engine time (the slowest worker's):
        'copy' (copies into vLLM's tensors), 'post' (the backend's processing after loading) and their
        sum 'load'; these need the workers to carry `RefitWorkerExtension` (`worker_extension_cls=`).
        """
        self.connect()
        if self.staged:
            return self._refit_staged(version)

        if self._canary is not None:
            self._canary.reference(version)

        def engine_side() -> None:
            self._start_update()
            self.llm.update_weights({"update_info": {"version": version}})
            self.llm.finish_weight_update(weight_version=str(version))

        try:
            stats = self._concurrently(lambda: self.sender.refit(version), engine_side)
        except HandshakeError:
            raise  # nothing was loaded: vLLM still serves the last committed weights
        except Exception as e:
            self.failure = f"refit of version {version} failed: {e}"
            raise
        self.failure = ""
        self._settle_cache(version)
        self._add_engine_seconds(stats)
        if self._probed(version):
            stats.seconds["canary"] = self._canary.seconds  # type: ignore[union-attr]
        return stats

    def _refit_staged(self, version: int) -> Any:
        stats = self.stage(version)
        stats.seconds["pause"] = self.apply(version)
        self._add_engine_seconds(stats)
        if self._canary is not None and self._canary.ran == version:  # apply() ran the probe
            stats.seconds["canary"] = self._canary.seconds
        return stats

    def _probed(self, version: int) -> bool:
        """The canary after `version` was applied, before generation goes on; a failure marks every worker's
        version failed, refuses `generate` and raises RefitError naming the first token that diverges."""
        if self._canary is None:
            return False
        manifest = getattr(self.sender, "manifest", None)
        dtypes = [p.spec.dtype for p in manifest.entries] if manifest is not None else []
        config = getattr(getattr(self.llm, "llm_engine", None), "model_config", None)
        try:
            return self._canary.check(self.llm, version, self.cache_salt, [*dtypes, getattr(config, "dtype", None)])
        except RefitError as e:
            self.failure = str(e)
            self._rpc("refit_fail", version, self.failure)
            raise

    def stage(self, version: int) -> Any:
        """Staged only: push `version` into the workers' staging memory while vLLM keeps generating with the
        version it holds; returns the Sender's stats once every worker verified and committed it there.
        A failure here never touched vLLM's weights (it stays current on the last applied version)."""
        if not self.staged:
            raise ValueError("stage() needs VllmRefit(..., staged=True); refit() loads unstaged refits")
        self.connect()
        if self._canary is not None:
            self._canary.reference(version)  # the trainer as it is now: what is staged
        try:
            return self.sender.refit(version)
        except RefitError:
            raise
        except Exception:
            self.sender.close()  # the trainer's own failure: end the workers' wait for buckets now
            raise

    def apply(self, version: int) -> float:
        """Staged only: the final copy of staged `version` into vLLM's tensors, its version set, and the prefix
        cache reset, inside vLLM's pause (mode 'keep': in-flight requests wait, none is aborted). Returns
        the seconds generation was paused (from the pause to the resume, as the trainer saw them)."""
        if not self.staged:
            raise ValueError("apply() needs VllmRefit(..., staged=True)")
        t = time.perf_counter()
        pause, resume = getattr(self.llm, "pause_generation", None), getattr(self.llm, "resume_generation", None)
        paused = callable(pause) and callable(resume)  # an offline LLM generates only inside generate()
        if paused:
            pause(mode="keep")
        try:
            try:
                self._start_update()
                self.llm.update_weights({"update_info": {"version": version}})
                self.llm.finish_weight_update(weight_version=str(version))
                self.failure = ""
            except Exception as e:
                self.failure = f"applying staged version {version} failed: {e}"
                raise RefitError(f"vLLM worker failed: {e}") from e
            finally:
                self._settle_cache(version)
            self._probed(version)  # before the resume: no request runs on weights the canary refuses
        finally:
            if paused:
                resume()
        return time.perf_counter() - t

    def _start_update(self) -> None:
        """vLLM's start call: its draft session when the source carries draft tensors (`draft.<name>`, see
        refit.integrations.vllm.drafted), so the target and the draft are refitted as one version."""
        names = (n for s in self.sender.source.specs() for n in s.names)
        if any(n.startswith(DRAFT_PREFIX) for n in names):
            start = getattr(self.llm, "start_draft_weight_update", None)
            if not callable(start):
                raise RefitError(
                    f"the source carries {DRAFT_PREFIX}* tensors, but {type(self.llm).__name__} has no "
                    "start_draft_weight_update: this vLLM cannot update a draft model"
                )
            start()
        else:
            self.llm.start_weight_update()

    @property
    def cache_salt(self) -> str | None:
        """Policy 'salt': the committed version's cache salt, for requests that do not go through `generate()`
        (vLLM's `cache_salt` of a prompt or an OpenAI request); None under other policies or before a commit."""
        return self._salt.current if self.cache_policy == "salt" else None

    def _settle_cache(self, version: int) -> None:
        """The cache policy at the commit of `version`."""
        if self.cache_policy == "reset":
            self._reset_kv(version)
        elif self.cache_policy == "salt":
            self._salt.advance(version)

    def _reset_kv(self, version: int) -> None:
        """Drop every KV block computed with the old weights, the kept requests' too: they are preempted and
        recomputed with the new weights on resume (vLLM refuses the reset while requests hold blocks, and a
        failed reset would leave old KV for new requests to hit)."""
        try:
            ok = self.llm.reset_prefix_cache(reset_running_requests=True)
        except TypeError:  # a client whose reset takes no arguments
            ok = self.llm.reset_prefix_cache()
        if ok is False:
            log.warning("vLLM did not reset its prefix cache after version %d: KV of the old weights remains", version)

    def _rpc(self, method: str, *args: Any) -> Any:
        """`collective_rpc(method)` where the workers carry RefitWorkerExtension; None where they do not."""
        rpc = getattr(self.llm, "collective_rpc", None)
        config = getattr(getattr(self.llm, "llm_engine", None), "vllm_config", None)
        extension = str(getattr(getattr(config, "parallel_config", None), "worker_extension_cls", "") or "")
        if rpc is None or (config is not None and "RefitWorkerExtension" not in extension):
            # An RPC the workers lack fails inside vLLM's executor, which then stops serving: never send one.
            return None
        return rpc(method, args=args) if args else rpc(method)

    def _add_engine_seconds(self, stats: Any) -> None:
        try:
            per_worker = self._rpc("refit_engine_seconds")
        except Exception as e:  # noqa: BLE001 - vLLM re-raises a worker's error under its own types; the refit itself succeeded
            if not self._rpc_warned:
                self._rpc_warned = True
                log.warning(
                    "workers' engine time unavailable (stats keep the Sender's only; is the worker extension "
                    "refit.integrations.vllm.RefitWorkerExtension set?): %s: %s",
                    type(e).__name__,
                    e,
                )
            return
        if per_worker is None:
            return
        for key in ("copy", "post", "load", "apply"):
            if key != "apply" or any(key in w for w in per_worker):  # 'apply': the staged final copy only
                stats.seconds[key] = max((w.get(key, 0.0) for w in per_worker), default=0.0)

    def generate(self, prompts: Any, *args: Any, allow_failed: bool = False, **kwargs: Any) -> Any:
        """`llm.generate`, refused while the weights are mixed after a failed refit. Under cache policy 'salt'
        every prompt (a string or a dict) carries the committed version's `cache_salt`."""
        if self.failure and not allow_failed:
            raise RefitError(f"vLLM holds mixed weights ({self.failure}); retry the refit, or pass allow_failed=True")
        salt = self.cache_salt
        return self.llm.generate(prompts if salt is None else salted(prompts, salt), *args, **kwargs)

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            log.warning("closing the Sender while its refit thread still runs")
        self.sender.close()


def _outcome(result: dict[str, Any], engine_error: Exception | None) -> Any:
    """The trainer side's value, or the error that tells the most: a refused manifest first, then both sides."""
    trainer_error = result.get("error")
    if isinstance(trainer_error, HandshakeError):
        raise trainer_error
    if engine_error is not None:
        msg = f"vLLM worker failed: {engine_error}"
        if trainer_error is not None:
            msg += f"; trainer side: {type(trainer_error).__name__}: {trainer_error}"
        raise RefitError(msg) from engine_error  # vLLM's own error; the trainer's is in the message
    if trainer_error is not None:
        raise trainer_error
    return result.get("value")
