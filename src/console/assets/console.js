// embed-dlq console: the live tail. Every value from an event is set as text (textContent),
// never parsed as HTML. The EventSource reconnects by itself and resumes after the last event
// it received (Last-Event-ID).
(function () {
  "use strict";
  var status = document.getElementById("events-status");
  var body = document.getElementById("events-body");
  if (!status || !body || !window.EventSource) { return; }
  var from = status.getAttribute("data-from") || "$";
  var source = new EventSource("/events/stream?from=" + encodeURIComponent(from));
  function cell(tr, text, cls) {
    var td = document.createElement("td");
    if (cls) { td.className = cls; }
    td.textContent = text == null ? "" : String(text);
    tr.appendChild(td);
    return td;
  }
  source.addEventListener("dlq", function (e) {
    var d;
    try { d = JSON.parse(e.data); } catch (err) { return; }
    var tr = document.createElement("tr");
    tr.className = "live";
    cell(tr, d.at, "t");
    var ev = cell(tr, "");
    if (typeof d.dlq_id === "number" && isFinite(d.dlq_id)) {
      var a = document.createElement("a");
      a.href = "/dlq/" + String(Math.trunc(d.dlq_id));
      a.textContent = String(d.event);
      ev.appendChild(a);
    } else {
      ev.textContent = String(d.event);
    }
    cell(tr, d.table);
    cell(tr, d.doc_id, "doc");
    cell(tr, d.chunk_index, "num");
    cell(tr, d.generation, "num");
    cell(tr, d.details);
    body.insertBefore(tr, body.firstChild);
    while (body.children.length > 500) { body.removeChild(body.lastChild); }
    status.textContent = "live";
  });
  // The stream was trimmed past the position this page resumed from: say so in the table,
  // where the missing rows would have been, and in the status.
  source.addEventListener("gap", function (e) {
    var d;
    try { d = JSON.parse(e.data); } catch (err) { return; }
    var tr = document.createElement("tr");
    tr.className = "live gap";
    var td = cell(tr, (d.exact ? "" : "up to ") + String(d.missing) + " events missed: the stream was trimmed past "
      + String(d.after) + " (shard " + String(d.shard) + ")");
    td.colSpan = 7;
    body.insertBefore(tr, body.firstChild);
    status.textContent = "live (gap: " + (d.exact ? "" : "up to ") + String(d.missing) + " events missed)";
  });
  source.onopen = function () { status.textContent = "live"; };
  source.onerror = function () { status.textContent = "reconnecting…"; };
})();
