"""Anthropic Messages API (``/v1/messages``): on the same chat trees and prefix matching as
``/v1/chat/completions``. Being built (issue 25)."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter(tags=["anthropic"])
