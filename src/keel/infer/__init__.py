"""Generation and chat on a loaded model; never imports keel.train."""

from keel.infer.chat import chat_once, interactive_chat
from keel.infer.generate import generate_reply

__all__ = ["chat_once", "generate_reply", "interactive_chat"]
