// The overview's chart: the prefix hit rate per model, sampled from /ui/hit-rates.json every
// few seconds since the page opened. No inline script anywhere: the page's CSP forbids it.
"use strict";
(function () {
  function start() {
    var el = document.getElementById("hit-chart");
    if (!el || typeof uPlot === "undefined") return;
    var src = el.getAttribute("data-src");
    var everyMs = 1000 * Number(el.getAttribute("data-every-s") || 3);
    var now = document.getElementById("hit-now");
    var times = [];
    var series = {}; // model -> [hit rate per sample]
    var plot = null;
    var palette = ["#0a4fa8", "#a3140e", "#1d5e20", "#7a4b00", "#5b2a86"];

    function draw() {
      var models = Object.keys(series).sort();
      var data = [times].concat(models.map(function (m) { return series[m]; }));
      if (plot && plot.series.length !== models.length + 1) { plot.destroy(); plot = null; }
      if (!plot) {
        plot = new uPlot({
          width: Math.max(320, el.clientWidth || 600), height: 200,
          scales: { y: { range: [0, 1] } },
          series: [{}].concat(models.map(function (m, i) {
            return { label: m, stroke: palette[i % palette.length], width: 2 };
          })),
          axes: [{}, { values: function (u, v) { return v.map(function (x) { return Math.round(x * 100) + "%"; }); } }],
        }, data, el);
      } else {
        plot.setData(data);
      }
    }

    function sample() {
      fetch(src, { credentials: "same-origin", headers: { "Accept": "application/json" } })
        .then(function (r) { return r.ok ? r.json() : null; })
        .then(function (body) {
          if (!body) return;
          var models = body.models || {};
          times.push(body.at);
          Object.keys(models).forEach(function (m) {
            if (!series[m]) series[m] = times.slice(0, -1).map(function () { return null; });
          });
          Object.keys(series).forEach(function (m) {
            var row = models[m];
            series[m].push(row && row.hit_rate !== null ? row.hit_rate : null);
          });
          if (times.length > 600) { times.shift(); Object.keys(series).forEach(function (m) { series[m].shift(); }); }
          now.textContent = Object.keys(models).sort().map(function (m) {
            var r = models[m];
            return m + ": " + (r.hit_rate === null ? "no decisions yet" : Math.round(r.hit_rate * 100) + "% of " + r.decisions + " decisions");
          }).join("; ") || "No routing decisions yet.";
          draw();
        })
        .catch(function () { /* the next sample retries */ });
    }
    sample();
    setInterval(sample, everyMs);
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
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
