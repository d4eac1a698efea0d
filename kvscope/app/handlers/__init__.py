"""Event handlers, one module per tab: UI values in, engine results and viz figures out (no Gradio imports here).

Each handler takes the shared :class:`~kvscope.app.state.ModelRegistry` / :class:`~kvscope.app.state.SessionStore` explicitly and the
UI's values as keyword arguments (or one dataclass where values travel together: the Notes tab's
:class:`~kvscope.app.handlers.notes.EditInputs`, the Composer's :class:`~kvscope.app.handlers.composer.Composition`), so it can be
unit-tested without a browser and no call depends on the order of its inputs. Bad input raises
:class:`~kvscope.app.handlers.common.AppError` with a message for the user; nothing is stored before a computation succeeds.
"""
