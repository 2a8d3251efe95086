//! The board's HTML: a page frame, escaping, tables and links. Every text from the database
//! or a broker goes through [`escape`]; nothing on a page is a script.

use std::fmt::Write as _;

/// `text` safe inside HTML text and attribute values.
pub(super) fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// `text` percent-encoded for a query string value.
pub(super) fn query_value(text: &str) -> String {
    let mut out = String::with_capacity(text.len() * 3);
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// A whole page: `title` and `body` (already HTML) in the board's frame.
pub(super) fn frame(title: &str, body: &str) -> String {
    format!(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <title>{title} · consumer board</title><style>{STYLE}</style></head>\
         <body><header><a href=\"/\">consumer board</a></header><main>\
         <h1>{title}</h1>{body}</main></body></html>\n",
        title = escape(title),
    )
}

/// A table of `header` and `rows` (cells already HTML), with `id` for its element.
pub(super) fn table(id: &str, header: &[&str], rows: &[Vec<String>]) -> String {
    let mut out = format!("<table id=\"{}\"><thead><tr>", escape(id));
    for h in header {
        let _ = write!(out, "<th>{}</th>", escape(h));
    }
    out.push_str("</tr></thead><tbody>");
    for row in rows {
        out.push_str("<tr>");
        for cell in row {
            let _ = write!(out, "<td>{cell}</td>");
        }
        out.push_str("</tr>");
    }
    if rows.is_empty() {
        let _ = write!(out, "<tr><td colspan=\"{}\">none</td></tr>", header.len());
    }
    out.push_str("</tbody></table>");
    out
}

/// A link to `href` (already encoded) reading `text`.
pub(super) fn link(href: &str, text: &str) -> String {
    format!("<a href=\"{}\">{}</a>", escape(href), escape(text))
}

/// Seconds as `12s`, `-` for none.
pub(super) fn age(secs: Option<f64>) -> String {
    secs.map_or_else(|| "-".to_owned(), |s| format!("{s:.0}s"))
}

const STYLE: &str = "body{font-family:system-ui,sans-serif;margin:0;color:#1d2430}\
header{background:#1d2430;padding:.6em 1.2em}header a{color:#fff;text-decoration:none;\
font-weight:600}main{padding:0 1.2em 2em}table{border-collapse:collapse;margin:.4em 0 1.4em}\
th,td{border:1px solid #c9ced6;padding:.3em .6em;text-align:left;vertical-align:top}\
th{background:#eef1f5}pre{background:#f6f8fa;padding:.6em;overflow:auto;max-width:100%}\
.note{color:#5a6472}button{font-size:1em;padding:.3em .9em}";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_escaped_and_query_values_encoded() {
        assert_eq!(
            escape("<script>\"x\" & 'y'</script>"),
            "&lt;script&gt;&quot;x&quot; &amp; &#39;y&#39;&lt;/script&gt;"
        );
        assert_eq!(
            query_value("order # rejected/1"),
            "order%20%23%20rejected%2F1"
        );
    }
}
