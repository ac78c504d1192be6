// Live updates: the server sends the overview's fragments, rendered (and escaped) once per poll;
// they replace the elements of the same id. Nothing else runs here.
"use strict";
(function () {
  const live = document.querySelector("[data-live]");
  if (!live || !window.EventSource) return;
  const events = new EventSource(live.getAttribute("data-live"));
  events.addEventListener("snapshot", function (event) {
    const update = JSON.parse(event.data);
    for (const [id, html] of Object.entries(update.parts)) {
      const element = document.getElementById(id);
      if (element) element.innerHTML = html;
    }
    document.body.setAttribute("data-version", String(update.version));
  });
})();
