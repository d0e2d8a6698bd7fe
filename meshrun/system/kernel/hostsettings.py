"""Host settings meshrun changes outside its own devices (a routed site's LAN interface's reverse-path filter),
recorded once, durably, before the change, and put back from that record.

The record (``host-settings.json`` in the state directory) holds the value each setting had when meshrun first
changed it. A later change of the same setting keeps that first value, so an agent that crashed with the
setting loosened and was restarted (it now finds meshrun's own value) still knows what to put back; `restore`
(site untrusted, `meshrun leave`, `meshrun down`) writes every recorded value back and forgets it.

A setting is named by its path under /proc/sys ("net/ipv4/conf/eth0/rp_filter"); `root` is /proc/sys on a host
and a temporary directory in tests.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from meshrun.errors import StateError
from meshrun.system.files.statedir import atomic_write

__all__ = ["RECORD", "HostSettings"]

RECORD = "host-settings.json"
log = logging.getLogger(__name__)


class HostSettings:
    """The settings this member changed on its host and their values before; `record` is the file keeping them."""

    def __init__(self, record: Path | str, root: Path | str = "/proc/sys") -> None:
        self.record = Path(record)
        self.root = Path(root)

    def originals(self) -> dict[str, str]:
        """{setting: its value before meshrun first changed it}; {} when nothing is recorded."""
        try:
            data = json.loads(self.record.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise StateError(
                f"{self.record} is unreadable ({exc})",
                "set the host settings it names back by hand (sysctl), then remove it",
            ) from None
        if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
            raise StateError(f"{self.record} is corrupt", "set the settings back by hand (sysctl), then remove it")
        return data

    def adopt(self, setting: str, original: str) -> None:
        """Record `original` as `setting`'s value before meshrun, unless one is recorded (a record kept elsewhere
        by an older meshrun)."""
        originals = self.originals()
        if setting not in originals:
            originals[setting] = original
            self._save(originals)

    def read(self, setting: str) -> str:
        """`setting`'s current value (OSError when the host has no such setting)."""
        return (self.root / setting).read_text().strip()

    def change(self, setting: str, value: str) -> None:
        """Set `setting` to `value`, its current value recorded first (and durably) unless one is recorded
        already: the first value meshrun found is the one put back."""
        originals = self.originals()
        if setting not in originals:
            originals[setting] = self.read(setting)
            self._save(originals)
        (self.root / setting).write_text(value)

    def restore(self, prefix: str = "") -> dict[str, str]:
        """Write back every recorded setting whose name starts with `prefix` and forget it; returns what was
        put back. A setting that no longer exists (its interface is gone) is forgotten."""
        originals = self.originals()
        done: dict[str, str] = {}
        kept = dict(originals)
        for setting, value in sorted(originals.items()):
            if not setting.startswith(prefix):
                continue
            try:
                (self.root / setting).write_text(value)
                done[setting] = value
            except FileNotFoundError:
                log.info("%s is gone; nothing to put back", setting)
            except OSError as exc:  # kept in the record: the next restore tries again
                log.warning("could not put %s back to %s: %s", setting, value, exc)
                continue
            del kept[setting]
        if kept != originals:
            self._save(kept)
        return done

    def _save(self, originals: dict[str, str]) -> None:
        if originals:
            atomic_write(self.record, json.dumps(originals, indent=2, sort_keys=True) + "\n", 0o600)
        else:
            self.record.unlink(missing_ok=True)
