"""A click group whose subcommands are imported when they run (or when help lists them), not when
the group is: `dspark llm import` loads the `llm` module and nothing of `serve`, `rollout` or
`bench` (tritonclient, protobuf, pydantic ...). Click's documented LazyGroup pattern."""
from __future__ import annotations

import importlib

import click


class LazyGroup(click.Group):
    """``commands``: subcommand name -> ``"module:attribute"`` of its click command (or group)."""

    def __init__(self, *args, commands: dict[str, str], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lazy_commands = dict(commands)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self.lazy_commands))

    def get_command(self, ctx: click.Context, cmd_name: str):
        if cmd_name not in self.commands and cmd_name in self.lazy_commands:
            module, _, attribute = self.lazy_commands[cmd_name].partition(":")
            command = getattr(importlib.import_module(module), attribute)
            if not isinstance(command, click.Command) or command.name != cmd_name:
                raise TypeError(f"{self.lazy_commands[cmd_name]}: is not the click command {cmd_name!r}")
            self.add_command(command)
        return super().get_command(ctx, cmd_name)


def lazy_group(commands: dict[str, str], **settings):
    """``@lazy_group({...})`` in place of ``@click.group()``."""
    return click.group(cls=LazyGroup, commands=commands, **settings)


class LazyChoice(click.Choice):
    """A ``click.Choice`` whose choices come from ``load()`` when an option is parsed or its help
    shown, so the module that defines them is not imported with the command's module."""

    def __init__(self, load, case_sensitive: bool = True) -> None:
        self._load = load
        super().__init__((), case_sensitive)

    @property
    def choices(self) -> tuple:
        return tuple(self._load())

    @choices.setter
    def choices(self, value) -> None:  # click.Choice.__init__ sets it; the choices are load()'s
        pass
