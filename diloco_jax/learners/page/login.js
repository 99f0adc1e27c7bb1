// The sign-in form: the operator's credential goes as a header (Authorization: Bearer), never
// in a body or the address; a session cookie comes back and the page opens.
"use strict";

document.getElementById("signin").addEventListener("submit", async (event) => {
  event.preventDefault();
  const note = document.getElementById("note");
  const credential = document.getElementById("credential").value.trim();
  try {
    const r = await fetch("session", {
      method: "POST", headers: { Authorization: "Bearer " + credential },
    });
    if (r.ok) {
      location.replace("./");
      return;
    }
    note.textContent = r.status === 401 ? "That is not the operator's credential."
                                        : `The syncer answered HTTP ${r.status}.`;
  } catch (e) {
    note.textContent = "The syncer is not reachable (" + e.message + ").";
  }
});
