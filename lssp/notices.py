"""One-line notices to the user of what the library chose or is doing for them (the weight format ``auto`` picked,
a kernel being built): INFO records on the ``lssp.notices`` logger. The CLI shows them as plain lines on stderr;
a program using the library sees them only where it configures logging to."""
from __future__ import annotations

import logging

NOTICES = logging.getLogger("lssp.notices")


def notice(message: str, *args: object) -> None:
    """Tell the user ``message % args`` in one line."""
    NOTICES.info(message, *args)
