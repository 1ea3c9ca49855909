"""The status bar: tok/s, time to first token, cached tokens, parked conversations vs the cap, the
memory guard's reading, and one progress bar for whatever a person is waiting on."""
from __future__ import annotations

from PySide6.QtWidgets import QLabel, QProgressBar, QStatusBar

STAGES = {"load": "Loading model", "prefill": "Reading prompt", "save": "Saving session",
          "restore": "Restoring session", "download": "Downloading model", "extract": "Unpacking model",
          "verify": "Verifying model"}


def mib(n: int) -> str:
    return f"{n / (1 << 20):.1f}"


class StatusBar(QStatusBar):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.progress_label = QLabel()
        self.progress = QProgressBar(maximumWidth=180, textVisible=True)
        self.speed = QLabel("– tok/s")
        self.ttft = QLabel("ttft –")
        self.cached = QLabel("cached –")
        self.parked = QLabel("parked –")
        self.memory = QLabel("memory –")
        self.server = QLabel(visible=False)
        for w in (self.progress_label, self.progress):
            self.addPermanentWidget(w)
            w.hide()
        for w, tip in ((self.speed, "Decode speed of the last reply"),
                       (self.ttft, "Time to first token of the last reply"),
                       (self.cached, "Prompt tokens served from the conversation cache in the last reply"),
                       (self.parked, "Parked conversations and their memory against the cap"),
                       (self.memory, "The memory guard's reading"),
                       (self.server, "The OpenAI-compatible server (Settings)")):
            w.setToolTip(tip)
            self.addPermanentWidget(w)

    def show_server(self, st: dict) -> None:
        if st.get("running"):
            self.server.setText(f"server on :{st['port']}")
            self.server.setToolTip(f"OpenAI-compatible server at http://{st['host']}:{st['port']}/v1")
            self.server.show()
        else:
            self.server.setText("server off")
            self.server.setToolTip(st.get("error") or "The OpenAI-compatible server (Settings)")
            self.server.setVisible(bool(st.get("error")))

    def show_progress(self, stage: str, done: int, total: int) -> None:
        if total <= 0 or done >= total:
            self.hide_progress()
            return
        self.progress_label.setText(STAGES.get(stage, stage))
        self.progress.setRange(0, 1000)
        self.progress.setValue(int(1000 * done / total))
        self.progress_label.show()
        self.progress.show()

    def busy(self, stage: str) -> None:
        self.progress_label.setText(STAGES.get(stage, stage))
        self.progress.setRange(0, 0)
        self.progress_label.show()
        self.progress.show()

    def hide_progress(self) -> None:
        self.progress.hide()
        self.progress_label.hide()

    def clear_result(self) -> None:
        """A tab with no reply yet: no figures (never another tab's)."""
        self.speed.setText("– tok/s")
        self.ttft.setText("ttft –")
        self.cached.setText("cached –")

    def show_live(self, tps: float) -> None:
        self.speed.setText(f"{tps:.1f} tok/s (streaming)")

    def show_streaming(self, live: dict) -> None:
        """A reply in flight (ChatView.live): its figures so far, never the previous reply's."""
        tps, ttft = live.get("tps"), live.get("ttft_ms")
        self.speed.setText(f"{tps:.1f} tok/s (streaming)" if tps else "– tok/s (streaming)")
        self.ttft.setText(f"ttft {ttft:.0f} ms" if ttft is not None else "ttft … (reading the prompt)")
        if live.get("prompt_tokens"):
            self.cached.setText(f"cached {live.get('cached_tokens', 0)}/{live['prompt_tokens']} tokens")
        else:
            self.cached.setText("cached –")

    def show_result(self, r) -> None:
        """`r`: a reply's engine.api.Generation."""
        spec = ""
        if r.speculative != "off":     # speculative decoding: its acceptance
            spec = f" · {r.accepted_tokens}/{r.drafted_tokens} drafts accepted"
            if r.speculation_stopped and not r.drafted_tokens:
                spec = " · speculation off"
        self.speed.setToolTip("Decode speed of the last reply" + (
            f"\nSpeculation stopped: {r.speculation_stopped}" if r.speculation_stopped else ""))
        self.speed.setText(f"{r.decode_tps:.1f} tok/s{spec}")
        self.ttft.setText(f"ttft {r.ttft_ms:.0f} ms")
        self.cached.setText(f"cached {r.cached_tokens}/{r.prompt_tokens} tokens")

    def show_parking(self, p: dict) -> None:
        """`p`: parking.Parking.status() (from a Status or the engine's KVChanged event)."""
        if p:
            self.parked.setText(f"parked {p.get('entries', 0)} · {mib(p.get('bytes', 0))} / "
                                f"{mib(p.get('cap_bytes', 0))} MiB")

    def show_status(self, s) -> None:
        """`s`: engine.api.EngineStatus."""
        self.show_parking(s.parking or {})
        m = s.memory
        if s.memory_unavailable:
            self.memory.setText(f"memory: {s.memory_unavailable}")
        elif m:
            self.memory.setText(f"memory {m['available_bytes'] / (1 << 30):.1f} of "
                                f"{m['total_bytes'] / (1 << 30):.1f} GiB free")
