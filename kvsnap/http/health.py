"""``GET /health``'s answer from the engine's state alone, so the staged app (``staged``) can
give it before the API routes exist and the routes give the same one after."""

from __future__ import annotations


def health_answer(engine, served_model_name: str) -> tuple[int, dict]:
    """(status code, body): 200 once warm, 503 while warming or after a failed warm-up."""
    if engine.failed is not None:
        return 503, {"status": "failed", "warm": False, "error": str(engine.failed)}
    if not engine.warm.is_set():
        return 503, {"status": "warming", "warm": False}
    return 200, {"status": "ok", "warm": True, "model": served_model_name}
