use consumer_core::handler;

#[handler]
struct SendInvoice;

fn main() {}
