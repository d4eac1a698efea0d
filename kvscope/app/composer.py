"""The composer's drag-and-drop skill list: a gr.HTML subclass (library zone → context zone).

The value is the ordered list of skill ids in the context. Chips can be dragged from the library into the context and
within it; ▲ ▼ ✕ buttons and a + on library chips do the same without a mouse. The skills the chosen scenario places
itself (``placed``: :meth:`SkillComposer.placed_by`) follow, fixed, so the list shows every skill the context splices.
Titles are escaped in Python (the template inserts raw HTML) and ``preprocess`` keeps only known ids, so nothing the
browser sends is trusted.
"""

from __future__ import annotations

import html
import re
from typing import Any

import gradio as gr

SAFE_ID = re.compile(r"^[A-Za-z0-9_-]+$")

TEMPLATE = """
<div class="kv-composer">
  <div class="kv-zone kv-library" data-zone="library">
    <div class="kv-zone-title">Skill library (drag →, or +)</div>
    ${library.map(s => `<div class="kv-chip" draggable="true" data-id="${s.id}" data-from="library" title="${s.title}">
        <span>${s.title}</span><button class="kv-btn" data-act="add" data-id="${s.id}" aria-label="add ${s.title}">+</button></div>`).join('')}
  </div>
  <div class="kv-zone kv-context" data-zone="context" id="kv-context-zone">
    <div class="kv-zone-title">Context, in order (drop here)</div>
    ${(value || []).length === 0 && (placed || []).length === 0 ? '<div class="kv-empty">No skills yet</div>' : ''}
    ${(value || []).map((id, i) => `<div class="kv-chip kv-in" draggable="true" data-id="${id}" data-index="${i}" data-from="context">
        <span>${i + 1}. ${(library.find(s => s.id === id) || {title: id}).title}</span>
        <span><button class="kv-btn" data-act="up" data-index="${i}" aria-label="move up">▲</button><button class="kv-btn" data-act="down" data-index="${i}" aria-label="move down">▼</button><button class="kv-btn" data-act="remove" data-index="${i}" aria-label="remove">✕</button></span>
      </div>`).join('')}
    ${(placed || []).map(s => `<div class="kv-chip kv-placed" data-id="${s.id}" title="placed by the scenario ${s.scenario}">
        <span>${s.title}</span><span class="kv-note">placed by the scenario</span></div>`).join('')}
  </div>
</div>
"""

CSS = """
.kv-composer { display: flex; gap: 12px; }
.kv-zone { flex: 1; min-height: 160px; border: 1px dashed var(--border-color-primary); border-radius: 8px; padding: 8px; }
.kv-zone-title { font-weight: 600; margin-bottom: 6px; font-size: 13px; }
.kv-chip { display: flex; justify-content: space-between; align-items: center; gap: 6px; padding: 4px 8px; margin: 4px 0;
  border-radius: 6px; background: var(--background-fill-secondary); cursor: grab; font-size: 13px; }
.kv-in { background: #e8f4f2; }
.kv-btn { border: none; background: transparent; cursor: pointer; padding: 0 3px; }
.kv-empty { color: var(--body-text-color-subdued); font-size: 13px; }
.kv-placed { background: #eef0f6; cursor: default; }
.kv-note { color: var(--body-text-color-subdued); font-size: 12px; }
"""

JS = """
const list = () => [...(props.value || [])];
const commit = (next) => { props.value = next; };
element.addEventListener('dragstart', (e) => {
  const chip = e.target.closest('.kv-chip');
  if (!chip) return;
  e.dataTransfer.setData('text/plain', JSON.stringify({id: chip.dataset.id, from: chip.dataset.from, index: chip.dataset.index}));
});
element.addEventListener('dragover', (e) => { if (e.target.closest('.kv-zone')) e.preventDefault(); });
element.addEventListener('drop', (e) => {
  const zone = e.target.closest('.kv-zone');
  if (!zone) return;
  e.preventDefault();
  const data = JSON.parse(e.dataTransfer.getData('text/plain') || '{}');
  if (!data.id) return;
  const next = list();
  if (data.from === 'context') next.splice(Number(data.index), 1);
  if (zone.dataset.zone === 'context') {
    const target = e.target.closest('.kv-in');
    let at = target ? Number(target.dataset.index) : next.length;
    if (data.from === 'context' && target && Number(data.index) < at) at -= 1;
    if (!next.includes(data.id)) next.splice(at, 0, data.id);
  }
  commit(next);
});
element.addEventListener('click', (e) => {
  const button = e.target.closest('.kv-btn');
  if (!button) return;
  const next = list();
  const i = Number(button.dataset.index);
  if (button.dataset.act === 'add' && !next.includes(button.dataset.id)) next.push(button.dataset.id);
  if (button.dataset.act === 'remove') next.splice(i, 1);
  if (button.dataset.act === 'up' && i > 0) [next[i - 1], next[i]] = [next[i], next[i - 1]];
  if (button.dataset.act === 'down' && i < next.length - 1) [next[i + 1], next[i]] = [next[i], next[i + 1]];
  commit(next);
});
"""


class SkillComposer(gr.HTML):
    """Ordered skill ids, edited by drag and drop (or buttons) between a library and a context zone."""

    def __init__(self, library: dict[str, str], value: list[str] | None = None, placed: list[dict] | None = None, **kwargs: Any) -> None:
        self.library_ids = [skill_id for skill_id in library if SAFE_ID.match(skill_id)]
        self.titles = dict(library)
        entries = [{"id": skill_id, "title": html.escape(library[skill_id], quote=True)} for skill_id in self.library_ids]
        super().__init__(
            value=self._clean(value or []),
            html_template=TEMPLATE,
            css_template=CSS,
            js_on_load=JS,
            library=entries,
            placed=placed or [],
            **kwargs,
        )

    def placed_by(self, scenario: str, skill_ids: list[str]) -> list[dict[str, str]]:
        """The ``placed`` entries for the skills ``scenario`` places itself (titles escaped; unknown ids by their id)."""
        return [
            {
                "id": skill_id,
                "title": html.escape(self.titles.get(skill_id, skill_id), quote=True),
                "scenario": html.escape(scenario, quote=True),
            }
            for skill_id in skill_ids
            if SAFE_ID.match(skill_id)
        ]

    def _clean(self, ids: Any) -> list[str]:
        """Known, well-formed ids only, each once, in order."""
        if not isinstance(ids, list):
            return []
        kept: list[str] = []
        for skill_id in ids:
            if isinstance(skill_id, str) and SAFE_ID.match(skill_id) and skill_id in self.library_ids and skill_id not in kept:
                kept.append(skill_id)
        return kept

    def preprocess(self, payload: Any) -> list[str]:
        return self._clean(payload)

    def postprocess(self, value: Any) -> list[str]:
        return self._clean(value)

    def api_info(self) -> dict:
        return {"type": "array", "items": {"type": "string", "enum": self.library_ids}, "title": "Skill ids in context order"}
