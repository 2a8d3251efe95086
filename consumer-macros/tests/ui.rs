//! UI tests: `pass/` must compile and run, `fail/` must fail with exactly the errors in the
//! `.stderr` next to each file. Regenerate those with `TRYBUILD=overwrite cargo test -p
//! consumer-macros --test ui`, then read every diff: each error must point at the token that
//! causes it.

#[test]
fn ui() {
    let cases = trybuild::TestCases::new();
    cases.pass("tests/ui/pass/*.rs");
    cases.compile_fail("tests/ui/fail/*.rs");
}
