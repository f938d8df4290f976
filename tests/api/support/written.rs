//! Documentation run as written: the `sh` blocks a document marks with
//! `<!-- run as written by <test file> -->`, read from the document itself and cut into
//! commands in their order, for a test to run each with `bash` exactly as an operator pastes it.

use std::path::Path;

/// The commands of every `sh` block after each `mark` in `document` (a path from the
/// repository's root), in order: continued lines joined, a here-document kept with its command,
/// comments and blank lines left out.
pub fn commands_marked(document: &str, mark: &str) -> Vec<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(document);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|error| panic!("{document}: {error}"));
    let blocks: Vec<&str> = text
        .split(mark)
        .skip(1)
        .map(|after| {
            after
                .split_once("```sh\n")
                .and_then(|(_, rest)| rest.split_once("\n```"))
                .unwrap_or_else(|| panic!("{document}: no sh block after a mark"))
                .0
        })
        .collect();
    assert!(
        !blocks.is_empty(),
        "{document} marks no block with {mark:?}"
    );
    blocks.into_iter().flat_map(commands_of).collect()
}

fn commands_of(block: &str) -> Vec<String> {
    let mut commands = Vec::new();
    let mut lines = block.lines();
    while let Some(line) = lines.next() {
        if line.trim().is_empty() || line.trim_start().starts_with('#') {
            continue;
        }
        let mut command = line.to_owned();
        while command.ends_with('\\') {
            command.push('\n');
            command.push_str(lines.next().expect("a continued line"));
        }
        if let Some(delimiter) = command
            .split("<<'")
            .nth(1)
            .and_then(|rest| rest.split('\'').next())
            .map(str::to_owned)
        {
            for body in lines.by_ref() {
                command.push('\n');
                command.push_str(body);
                if body == delimiter {
                    break;
                }
            }
        }
        commands.push(command);
    }
    commands
}
