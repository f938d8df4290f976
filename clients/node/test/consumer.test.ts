// The consumer helpers: markProcessed says which events are new; processOnce runs an effect
// once per event.
import assert from 'node:assert/strict';

import { testOnEveryStore } from './support/harness';

testOnEveryStore('markProcessed returns the ids seen for the first time, in request order', async ({ client }) => {
  const first = await client.markProcessed('billing', ['evt-1', 'evt-2', 'evt-1']);
  assert.deepEqual(first.newEventIds, ['evt-1', 'evt-2']);
  assert.deepEqual(
    first.events.map((event) => [event.eventId, event.alreadyProcessed]),
    [['evt-1', false], ['evt-2', false], ['evt-1', true]],
  );
  const second = await client.markProcessed('billing', ['evt-2', 'evt-3']);
  assert.deepEqual(second.newEventIds, ['evt-3']);
  assert.equal(second.events[0]?.processedAt.getTime(), first.events[1]?.processedAt.getTime());
  // Consumers are separate scopes.
  assert.deepEqual((await client.markProcessed('shipping', ['evt-1'])).newEventIds, ['evt-1']);
});

testOnEveryStore('processOnce runs the effect once per event, redeliveries get its result', async ({ client, newClient }) => {
  let emails = 0;
  const sendEmail = async () => {
    emails += 1;
    return { messageId: `msg-${emails}` };
  };
  const deliveries = await Promise.all([
    client.processOnce('notifier', 'evt-42', sendEmail, { waitMs: 10_000 }),
    newClient().processOnce('notifier', 'evt-42', sendEmail, { waitMs: 10_000 }),
  ]);
  const redelivery = await client.processOnce('notifier', 'evt-42', sendEmail);
  assert.equal(emails, 1);
  for (const delivery of [...deliveries, redelivery]) assert.deepEqual(delivery.value, { messageId: 'msg-1' });
  assert.equal(redelivery.replayed, true);
});
