//! `docs/env-contract.md`'s table, generated from [`VARIABLES`] so the docs
//! name exactly what the operator renders.

use crate::VARIABLES;

/// The markdown table of [`VARIABLES`].
pub fn variables_table() -> String {
    let mut table = String::from("| variable | value |\n|---|---|\n");
    for v in VARIABLES {
        let names: Vec<String> = v.names.iter().map(|n| format!("`{n}`")).collect();
        table.push_str(&format!("| {} | {} |\n", names.join(", "), v.meaning));
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOC: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/env-contract.md");
    const BEGIN: &str = "<!-- generated: streamfleet_contract::variables_table; write with STREAMFLEET_WRITE_DOCS=1 cargo test -p streamfleet-contract -->\n";
    const END: &str = "<!-- end of generated table -->";

    /// The docs' table is this crate's: regenerated on request, and a test
    /// fails while it differs.
    #[test]
    fn the_docs_table_is_the_generated_one() {
        let doc = std::fs::read_to_string(DOC).unwrap();
        let (head, rest) = doc.split_once(BEGIN).expect("docs/env-contract.md has the table's start marker");
        let (_, tail) = rest.split_once(END).expect("docs/env-contract.md has the table's end marker");
        let want = format!("{head}{BEGIN}{}{END}{tail}", variables_table());
        if std::env::var_os("STREAMFLEET_WRITE_DOCS").is_some() {
            std::fs::write(DOC, &want).unwrap();
            return;
        }
        assert!(
            doc == want,
            "docs/env-contract.md's table is not generated from VARIABLES: run STREAMFLEET_WRITE_DOCS=1 cargo test -p streamfleet-contract"
        );
    }
}
