//! An HTTP/1.1 proxy in front of the service that may rewrite what passes:
//! a request's target before it is forwarded, an answer's body before it
//! is passed back. One connection to the service per request.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;

/// Rewrites a request target (`/v1/receipts?…`) before it is forwarded.
pub type Retarget = Arc<dyn Fn(&str) -> String + Send + Sync>;
/// Rewrites an answer's body, given the target it answered.
pub type Rebody = Arc<dyn Fn(&str, Vec<u8>) -> Vec<u8> + Send + Sync>;

pub struct HttpProxy {
    pub url: String,
}

impl HttpProxy {
    pub fn start(upstream: String, retarget: Retarget, rebody: Rebody) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        let url = format!("http://{}", listener.local_addr().expect("address"));
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let (upstream, retarget, rebody) =
                    (upstream.clone(), Arc::clone(&retarget), Arc::clone(&rebody));
                std::thread::spawn(move || serve(client, &upstream, &*retarget, &*rebody));
            }
        });
        Self { url }
    }

    /// A proxy that passes everything as it is.
    pub fn honest(upstream: String) -> Self {
        Self::start(
            upstream,
            Arc::new(str::to_owned),
            Arc::new(|_: &str, body: Vec<u8>| body),
        )
    }
}

fn serve(
    client: TcpStream,
    upstream: &str,
    retarget: &(dyn Fn(&str) -> String + Send + Sync),
    rebody: &(dyn Fn(&str, Vec<u8>) -> Vec<u8> + Send + Sync),
) {
    let Ok(reading) = client.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(reading);
    let mut client = client;
    while let Some((head, body)) = read_message(&mut reader) {
        let mut parts = head.splitn(3, ' ');
        let (Some(method), Some(target), Some(rest)) = (parts.next(), parts.next(), parts.next())
        else {
            return;
        };
        let target = retarget(target);
        let head = format!("{method} {target} {rest}");
        let Ok(mut service) = TcpStream::connect(upstream) else {
            return;
        };
        if service
            .write_all(head.as_bytes())
            .and_then(|()| service.write_all(&body))
            .is_err()
        {
            return;
        }
        let Some((answer_head, answer_body)) = read_message(&mut BufReader::new(service)) else {
            return;
        };
        let answer_body = rebody(&target, answer_body);
        let answer_head: String = answer_head
            .split_inclusive("\r\n")
            .map(|line| match line.split_once(':') {
                Some((name, _)) if name.eq_ignore_ascii_case("content-length") => {
                    format!("content-length: {}\r\n", answer_body.len())
                }
                _ => line.to_owned(),
            })
            .collect();
        if client
            .write_all(answer_head.as_bytes())
            .and_then(|()| client.write_all(&answer_body))
            .is_err()
        {
            return;
        }
    }
}

/// One HTTP/1.1 message with a `Content-Length` body (or none): its head,
/// blank line included, and its body. `None` at the end of the stream.
pub fn read_message(reader: &mut BufReader<TcpStream>) -> Option<(String, Vec<u8>)> {
    let mut head = String::new();
    let mut length = 0usize;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).ok()? == 0 {
            return None;
        }
        if let Some((name, value)) = line.split_once(':')
            && name.eq_ignore_ascii_case("content-length")
        {
            length = value.trim().parse().ok()?;
        }
        head.push_str(&line);
        if line == "\r\n" {
            break;
        }
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body).ok()?;
    Some((head, body))
}
