// A small Markdown renderer that builds DOM nodes: every piece of model text becomes a text node, so no reply
// can turn into live HTML or script. Fenced code, headings, lists, quotes, paragraphs; inline code, bold,
// italics and http(s) links.

const FENCE = /^\s*(```+|~~~+)\s*([\w+#.-]*)\s*$/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const ITEM = /^\s*([-*+]|\d+[.)])\s+(.*)$/;
const QUOTE = /^\s*>\s?(.*)$/;
const INLINE = /\*\*(?=\S)([^\n]*?\S)\*\*|(?<![\w*])[*_](?=\S)([^*_\n]*?\S)[*_](?![\w*])|\[([^\]\n]+)\]\(([^)\s]+)\)/g;

function element(tag, parent, className) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  parent.append(node);
  return node;
}

function safeUrl(href) {
  try {
    const url = new URL(href, window.location.href);
    return url.protocol === "http:" || url.protocol === "https:" ? url.href : null;
  } catch {
    return null;
  }
}

// Inline code first, by a linear scan (a run of n backticks closes at the next run of exactly n; an unclosed run
// is text), then emphasis and links in what lies between.
export function renderInline(text, parent) {
  let last = 0;
  for (let at = text.indexOf("`"); at >= 0; at = text.indexOf("`", at)) {
    let end = at;
    while (text[end] === "`") end += 1;
    const run = text.slice(at, end);
    let close = text.indexOf(run, end);
    while (close >= 0 && text[close + run.length] === "`") {  // a longer run is no match: skip past it
      let past = close;
      while (text[past] === "`") past += 1;
      close = text.indexOf(run, past);
    }
    if (close < 0) {
      at = end;
      continue;
    }
    renderSpans(text.slice(last, at), parent);
    element("code", parent).textContent = text.slice(end, close);
    last = at = close + run.length;
  }
  renderSpans(text.slice(last), parent);
}

function renderSpans(text, parent) {
  let last = 0;
  for (const match of text.matchAll(INLINE)) {
    parent.append(text.slice(last, match.index));
    const [whole, bold, italic, label, href] = match;
    if (bold !== undefined) {
      renderSpans(bold, element("strong", parent));
    } else if (italic !== undefined) {
      renderSpans(italic, element("em", parent));
    } else {
      const url = safeUrl(href);
      if (url === null) {
        parent.append(whole);
      } else {
        const link = element("a", parent);
        link.href = url;
        link.rel = "noopener noreferrer";
        link.target = "_blank";
        link.textContent = label;
      }
    }
    last = match.index + whole.length;
  }
  parent.append(text.slice(last));
}

function lines(parent, rows) {
  rows.forEach((row, i) => {
    if (i > 0) element("br", parent);
    renderInline(row, parent);
  });
}

export function renderMarkdown(text, container) {
  container.replaceChildren();
  const rows = text.split("\n");
  let i = 0;
  while (i < rows.length) {
    const row = rows[i];
    const fence = row.match(FENCE);
    if (fence) {
      const body = [];
      for (i += 1; i < rows.length && !rows[i].trim().startsWith(fence[1]); i += 1) body.push(rows[i]);
      i += 1;  // past the closing fence (or the end of a reply still streaming)
      const code = element("code", element("pre", container));
      if (fence[2]) code.dataset.lang = fence[2];
      code.textContent = body.join("\n");
      continue;
    }
    if (!row.trim()) {
      i += 1;
      continue;
    }
    const heading = row.match(HEADING);
    if (heading) {
      renderInline(heading[2], element(`h${Math.min(heading[1].length + 2, 6)}`, container));
      i += 1;
      continue;
    }
    if (ITEM.test(row)) {
      const ordered = /^\s*\d/.test(row);
      const list = element(ordered ? "ol" : "ul", container);
      for (; i < rows.length && ITEM.test(rows[i]); i += 1) renderInline(rows[i].match(ITEM)[2], element("li", list));
      continue;
    }
    if (QUOTE.test(row)) {
      const quoted = [];
      for (; i < rows.length && QUOTE.test(rows[i]); i += 1) quoted.push(rows[i].match(QUOTE)[1]);
      lines(element("blockquote", container), quoted);
      continue;
    }
    const paragraph = [];
    for (; i < rows.length && rows[i].trim() && !FENCE.test(rows[i]) && !HEADING.test(rows[i]) &&
           !ITEM.test(rows[i]) && !QUOTE.test(rows[i]); i += 1) paragraph.push(rows[i]);
    lines(element("p", container), paragraph);
  }
}
