// Charts: a `.charts` element names a JSON source (data-src) answering
// {interval_s, charts: [{id, title, unit, kind?, times, series: [{label, values}]}], summary?}
// from the control plane's own ring (an hour at 10 s), so a chart shows history from before
// the page opened. One figure per chart, redrawn in place every interval_s. No inline script
// anywhere: the page's CSP forbids it.
"use strict";
(function () {
  var latest = { at: 0, window_s: 0 }; // the last ring answer's time and window
  var palette = ["#0a4fa8", "#a3140e", "#1d5e20", "#7a4b00", "#5b2a86", "#00637a", "#8a1d5c", "#3d4a00"];

  function fmt(unit) {
    return function (u, vals) {
      return vals.map(function (v) {
        if (v === null || v === undefined) return "";
        if (unit === "ratio") return Math.round(v * 100) + "%";
        if (unit === "seconds") return v < 1 ? Math.round(v * 1000) + " ms" : v.toFixed(1) + " s";
        if (unit === "rate") return v + "/s";
        return String(v);
      });
    };
  }

  function options(c, width, body) {
    var bars = c.kind === "bars" && uPlot.paths && uPlot.paths.bars;
    // A floor on the y range: an idle hour draws a flat line at 0, not an axis of 1e-9.
    var floor = { rate: 0.1, seconds: 0.01, count: 1 }[c.unit] || 1;
    var y = c.unit === "ratio" ? { range: [0, 1] } : { range: function (u, lo, hi) { return [0, Math.max((hi || 0) * 1.1, floor)]; } };
    // Bars are centred on their day: pad the axis by half a day either side so the first and
    // last are not cut in half.
    var x = bars ? { time: true, range: function (u, lo, hi) { return [lo - 43200, hi + 43200]; } } : { time: true };
    // A ring's chart spans its whole window, ending now (set on every redraw, see render).
    if (!bars && body.window_s) x = { time: true, range: function () { return [latest.at - latest.window_s, latest.at]; } };
    return {
      width: width, height: 180,
      scales: { x: x, y: y },
      legend: { live: true },
      series: [{}].concat(c.series.map(function (s, i) {
        var colour = palette[i % palette.length];
        var one = { label: s.label, stroke: colour, width: 2, points: { show: true, size: 4 } };
        if (bars) { one.paths = uPlot.paths.bars({ size: [0.6, 40] }); one.fill = colour + "99"; one.points = { show: false }; }
        return one;
      })),
      axes: [{}, { values: fmt(c.unit), size: 60 }],
    };
  }

  function points(c) {
    var n = 0;
    c.series.forEach(function (s) { s.values.forEach(function (v) { if (v !== null && v !== 0) n += 1; }); });
    return n;
  }

  function start(el) {
    var plots = {}; // chart id -> {fig, holder, plot, labels}
    var everyMs = 10000;

    function render(body) {
      var seen = {};
      if (body.window_s) { latest.at = body.at; latest.window_s = body.window_s; }
      (body.charts || []).forEach(function (c) {
        seen[c.id] = true;
        var entry = plots[c.id];
        var labels = c.series.map(function (s) { return s.label; }).join("\n");
        if (entry && entry.labels !== labels) {
          if (entry.plot) entry.plot.destroy();
          entry.holder.textContent = "";
          entry.plot = null;
        }
        if (!entry) {
          var fig = document.createElement("figure");
          fig.className = "chart";
          fig.setAttribute("data-chart", c.id);
          var cap = document.createElement("figcaption");
          cap.textContent = c.title;
          var holder = document.createElement("div");
          holder.setAttribute("role", "img");
          holder.setAttribute("aria-label", c.title + ", the last hour");
          fig.appendChild(cap);
          fig.appendChild(holder);
          el.appendChild(fig);
          entry = plots[c.id] = { fig: fig, holder: holder, plot: null, labels: labels };
        }
        entry.labels = labels;
        entry.fig.setAttribute("data-points", String(points(c)));
        if (!c.series.length) {
          entry.holder.textContent = "No data yet.";
          entry.holder.className = "hint";
          return;
        }
        entry.holder.className = "";
        var data = [c.times].concat(c.series.map(function (s) { return s.values; }));
        if (entry.plot) {
          entry.plot.setData(data);
        } else {
          entry.holder.textContent = "";
          entry.plot = new uPlot(options(c, Math.max(300, entry.fig.clientWidth - 8), body), data, entry.holder);
        }
      });
      Object.keys(plots).forEach(function (id) {
        if (!seen[id]) { if (plots[id].plot) plots[id].plot.destroy(); plots[id].fig.remove(); delete plots[id]; }
      });
      var summary = el.getAttribute("data-summary");
      if (summary && body.summary !== undefined) document.getElementById(summary).textContent = body.summary;
      el.setAttribute("data-loaded", String(Date.now()));
    }

    function fetchOnce() {
      fetch(el.getAttribute("data-src"), { credentials: "same-origin", headers: { "Accept": "application/json" } })
        .then(function (r) { return r.ok ? r.json() : null; })
        .then(function (body) {
          if (!body) return;
          if (body.interval_s) everyMs = 1000 * body.interval_s;
          render(body);
        })
        .catch(function () { /* the next round retries */ })
        .then(function () { setTimeout(fetchOnce, everyMs); });
    }
    fetchOnce();
  }

  function startAll() {
    if (typeof uPlot === "undefined") return;
    Array.prototype.forEach.call(document.querySelectorAll(".charts[data-src]"), start);
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", startAll);
  else startAll();
})();

// A live region is not refreshed while the keyboard focus is inside it: the swap would drop
// the focus from the button a keyboard user had tabbed to (Revoke, Cordon, Drain).
document.addEventListener("htmx:beforeRequest", function (evt) {
  var target = evt.detail && evt.detail.elt;
  var active = document.activeElement;
  if (target && active && active !== document.body && target.contains(active)) {
    evt.preventDefault();
  }
});
