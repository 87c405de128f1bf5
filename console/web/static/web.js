// Progressive enhancement for the web view: following new traffic records without a reload.
// Records are attacker-controlled, so rows are built with textContent only, never innerHTML.
"use strict";

(function () {
  const toggle = document.getElementById("live");
  if (!toggle) return;
  const body = document.querySelector("#records tbody");
  const status = document.getElementById("live-status");
  let cursor = toggle.dataset.cursor;
  let running = false;

  function cell(text, className) {
    const td = document.createElement("td");
    if (className) td.className = className;
    td.textContent = text;
    return td;
  }

  function row(record) {
    const tr = document.createElement("tr");
    tr.className = "fresh";
    tr.dataset.id = record.id;
    const time = document.createElement("td");
    const link = document.createElement("a");
    link.href = record.url;
    link.textContent = record.time;
    time.appendChild(link);
    tr.appendChild(time);
    tr.appendChild(cell(record.cvm));
    tr.appendChild(cell(record.owner, "wrap"));
    tr.appendChild(cell(record.method));
    tr.appendChild(cell(record.host, "wrap"));
    tr.appendChild(cell(record.path, "wrap"));
    const decision = cell(record.decision);
    const span = document.createElement("span");
    span.className = "decision " + (record.decision === "deny" ? "deny" : "allow");
    span.textContent = record.decision;
    decision.textContent = "";
    decision.appendChild(span);
    tr.appendChild(decision);
    tr.appendChild(cell(record.reason));
    tr.appendChild(cell(record.rule, "wrap"));
    tr.appendChild(cell(record.status));
    return tr;
  }

  async function follow() {
    running = true;
    status.textContent = "following";
    while (toggle.checked) {
      const url = toggle.dataset.url + "&after=" + encodeURIComponent(cursor);
      let response;
      try {
        response = await fetch(url, { credentials: "same-origin", redirect: "error" });
      } catch (error) {
        status.textContent = "stopped: the session ended or the Console is unreachable";
        toggle.checked = false;
        break;
      }
      if (!response.ok) {
        status.textContent = "stopped: " + response.status;
        toggle.checked = false;
        break;
      }
      const data = await response.json();
      const empty = body.querySelector("tr.empty");
      if (empty && data.records.length) empty.remove();
      for (const record of data.records) body.insertBefore(row(record), body.firstChild);
      if (data.cursor) cursor = data.cursor;
    }
    running = false;
    if (!toggle.checked && status.textContent === "following") status.textContent = "";
  }

  toggle.addEventListener("change", function () {
    if (toggle.checked && !running) follow();
  });
})();
