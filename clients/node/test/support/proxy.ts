// A TCP proxy between a client and the coordinator that can withhold the coordinator's answers
// (a reply lost on the network) and then cut every connection, as a network failure would, or
// hold them back and deliver them late (a slow network).
import * as net from 'node:net';

export class AnswerWithholdingProxy {
  private readonly sockets = new Set<net.Socket>();
  private withholding = false;
  private holding = false;
  private readonly held: Array<{ socket: net.Socket; chunk: Buffer }> = [];
  address = '';

  private constructor(private readonly server: net.Server) {}

  static async start(target: string): Promise<AnswerWithholdingProxy> {
    const [host, port] = splitAddress(target);
    const server = net.createServer();
    const proxy = new AnswerWithholdingProxy(server);
    server.on('connection', (client) => {
      const upstream = net.connect(port, host);
      proxy.track(client);
      proxy.track(upstream);
      client.on('data', (chunk) => upstream.write(chunk));
      // While withholding, the coordinator's bytes are dropped whole; the connection is cut
      // before anything passes again, so the client never sees a torn frame.
      upstream.on('data', (chunk: Buffer) => {
        if (proxy.withholding) return;
        if (proxy.holding) proxy.held.push({ socket: client, chunk });
        else client.write(chunk);
      });
      client.on('close', () => upstream.destroy());
      upstream.on('close', () => client.destroy());
      client.on('error', () => upstream.destroy());
      upstream.on('error', () => client.destroy());
    });
    await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
    const bound = server.address() as net.AddressInfo;
    proxy.address = `127.0.0.1:${bound.port}`;
    return proxy;
  }

  /** From now on the coordinator's answers are lost; requests still reach it. */
  withholdAnswers(): void {
    this.withholding = true;
  }

  /** From now on the coordinator's answers wait, in order, until deliverHeldAnswers. */
  holdAnswers(): void {
    this.holding = true;
  }

  deliverHeldAnswers(): void {
    this.holding = false;
    for (const { socket, chunk } of this.held.splice(0)) socket.write(chunk);
  }

  /** Cuts every open connection and lets new ones through in both directions. */
  cutAndRestore(): void {
    for (const socket of this.sockets) socket.destroy();
    this.withholding = false;
  }

  async close(): Promise<void> {
    for (const socket of this.sockets) socket.destroy();
    await new Promise<void>((resolve) => this.server.close(() => resolve()));
  }

  private track(socket: net.Socket): void {
    this.sockets.add(socket);
    socket.on('close', () => this.sockets.delete(socket));
  }
}

function splitAddress(address: string): [string, number] {
  const colon = address.lastIndexOf(':');
  return [address.slice(0, colon), Number(address.slice(colon + 1))];
}
